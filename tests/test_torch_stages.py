"""The stages that live inside PyTorch, recorded by ``stagetrace.integrations.pytorch``: the all-reduce of tensor
parallelism (one span per request and rank, folded over its collectives) and decode (a module's output).

The class of case: a tensor-parallel model whose rank computes with a corrupted shard of the weights (a faulty GPU,
a bad weight transfer). A real two-process gloo job (``tests/apps/tp_model.py``: a small random-weight model, two
ranks, ``all_reduce`` per layer) sends its spans with the official OTLP exporter into the OTLP receiver on a real
embedded store, and ``explain`` must name the all-reduce stage on the perturbed rank alone (the first collective at
which a rank's contribution differs), though every rank's later contributions took the corrupted sums in. Which request deviates is decided by the model's own outputs, never by the analysis.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from opentelemetry.context import Context

import stagetrace
from stagetrace import completion, lookup
from stagetrace.analysis.explain import Explainer
from stagetrace.digest import digest
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.integrations import pytorch as stagetrace_torch

APP = Path(__file__).parent / "apps" / "tp_model.py"
LAYERS, TOKENS = 2, 4  # the app's layers; tokens each request generates
PROMPT = [5, 17, 42]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- two ranks, one perturbed
def test_explain_names_the_allreduce_of_the_rank_whose_shard_was_perturbed(store):
    plan = {
        "requests": [{"id": f"tp-{i}", "prompt": PROMPT, "tokens": TOKENS} for i in range(3)]
        + [
            {"id": "tp-bad", "prompt": PROMPT, "tokens": TOKENS, "perturb_rank": 1},
            {"id": "tp-other", "prompt": [1, 2], "tokens": TOKENS},
        ]
    }
    receiver = OtlpReceiver(store, "127.0.0.1:0")
    try:
        port = _free_port()
        ranks = [
            subprocess.Popen(
                [sys.executable, str(APP), str(rank), "2", str(port), f"{receiver.url}/v1/traces", json.dumps(plan)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        results = [rank.communicate(timeout=240) for rank in ranks]
        for process, (_, err) in zip(ranks, results):
            assert process.returncode == 0, err
        assert receiver.writer.flush()
    finally:
        receiver.close()
    outputs = json.loads(results[0][0])
    # the premise, from the model itself: the perturbed shard changed the generated tokens, nothing else did
    assert outputs["tp-0"] == outputs["tp-1"] == outputs["tp-2"] != outputs["tp-bad"]

    trace = lookup.by_request_id(store, "tp-0")
    allreduce = {s.rank: s for s in trace.spans if s.stage == "allreduce"}
    decode = {s.rank: s for s in trace.spans if s.stage == "decode"}
    assert set(allreduce) == set(decode) == {"0", "1"}  # one span per request, stage and rank
    for rank, span in allreduce.items():
        assert span.resource["host.name"] == f"node-{rank}"
        assert span.attributes["allreduce.count"] == str(LAYERS * TOKENS)
        assert span.attributes["parallel.tp_size"] == "2"
        assert float(span.attributes["allreduce.time_ms"]) >= float(span.attributes["allreduce.max_ms"]) > 0
    # each rank contributes its own partial sums; the all-reduce leaves the same sums on both
    assert allreduce["0"].input_digest != allreduce["1"].input_digest
    assert allreduce["0"].output_digest == allreduce["1"].output_digest
    assert decode["0"].output_digest == decode["1"].output_digest and decode["0"].attributes["decode.batch_size"] == "3"

    assert not Explainer(store).explain("tp-1").to_json()["diverged"]
    report = Explainer(store).explain("tp-bad").to_json()
    assert report["diverged"] and report["first_divergent_stage"] == "allreduce", report["summary"]
    # after the first corrupted sum, rank 0's later contributions (the next layers, the next tokens) are computed
    # from it, so both ranks' folded contributions differ; the first collective at which a rank's differs names rank 1
    assert report["divergent_ranks"] == ["1"], report["summary"]
    compared = {(c["stage"], c["rank"]): c for c in report["stages"]}
    assert (
        compared[("allreduce", "1")]["input_matches"] is False
        and compared[("allreduce", "0")]["input_matches"] is False
    )
    assert not compared[("allreduce", "0")]["output_matches"] and not compared[("allreduce", "1")]["output_matches"]
    steps = {
        rank: span.attributes["stagetrace.stage.step_input_digests"].split(",") for rank, span in allreduce.items()
    }
    assert len(steps["0"]) == len(steps["1"]) == min(LAYERS * TOKENS, 256) and len(steps["0"][0]) == 16


# -- in this process: a group of one rank, and a row-wise model
@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    recording = stagetrace_torch.record_collectives()
    yield
    recording.remove()
    dist.destroy_process_group()


class RowWise(torch.nn.Module):
    """Every output row depends on its own input row only, by elementwise ops: batch-invariant by construction."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.embed = torch.nn.Embedding(16, 8)
        self.embed.weight.data = torch.randn(16, 8, generator=generator)
        self.head = Head(torch.randn(24, generator=generator))

    def forward(self, tokens):
        hidden = torch.tanh(self.embed(tokens) * 1.5)
        dist.all_reduce(hidden)
        return self.head(hidden)


class Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, hidden):
        return torch.sin(hidden.repeat(1, 3) * self.weight).to(torch.bfloat16)


def _stages(memory) -> dict[tuple[str, str], dict]:
    """(request ID, stage) -> the stage span's attributes."""
    finished = memory.get_finished_spans()
    ids = {
        s.context.span_id: s.attributes["stagetrace.request.id"]
        for s in finished
        if "stagetrace.request.id" in s.attributes
    }
    return {
        (ids[s.parent.span_id], s.attributes["stagetrace.stage"]): dict(s.attributes)
        for s in finished
        if "stagetrace.stage" in s.attributes
    }


def _root(request_id: str):
    return stagetrace.request(request_id, parent=Context())  # a request of its own, whatever else is open


def test_a_request_batched_with_others_digests_as_it_does_alone(group, spans):
    model = RowWise()
    stagetrace_torch.record_decode(model.head)
    with torch.no_grad():
        with _root("alone") as req, stagetrace_torch.serving(req):
            for _ in range(3):  # three decode steps: the stages fold all of them
                model(torch.tensor([7]))
        with _root("pair-alone") as req, stagetrace_torch.serving(req):
            for _ in range(3):
                model(torch.tensor([3, 9]))
        a, b, c = _root("a"), _root("b"), _root("c")
        with a, b, c, stagetrace_torch.serving([(a, [0, 3]), (b, 1), (c, slice(2, 3))]):
            for _ in range(3):
                model(torch.tensor([3, 7, 11, 9]))  # b holds row 1 (token 7); a rows 0 and 3 (tokens 3, 9)
    assert stagetrace.flush(5_000)
    got = _stages(spans)
    for stage in ("allreduce", "decode"):
        for key in ("stagetrace.stage.input_digest", "stagetrace.stage.output_digest"):
            assert got[("b", stage)][key] == got[("alone", stage)][key], (stage, key)
            assert got[("a", stage)][key] == got[("pair-alone", stage)][key], (stage, key)
            assert got[("c", stage)][key] != got[("b", stage)][key]
    assert got[("alone", "decode")]["decode.batch_size"] == 1 and got[("b", "decode")]["decode.batch_size"] == 4
    allreduce = got[("b", "allreduce")]
    assert allreduce["allreduce.count"] == 3 and allreduce["allreduce.bytes"] == 3 * 4 * 8 * 4  # 3 × (4, 8) fp32
    assert got[("b", "allreduce")]["parallel.tp_rank"] == 0 and got[("b", "allreduce")]["parallel.tp_size"] == 1
    # the folded digest is the digest of each call's digest, in order
    hidden = torch.tanh(model.embed(torch.tensor([7])) * 1.5).detach()
    assert got[("alone", "allreduce")]["stagetrace.stage.input_digest"] == digest([digest(hidden)] * 3)
    assert completion.DIGEST_ERROR not in got[("b", "decode")]


def test_a_sampler_recorded_without_its_inputs_records_token_ids_only(group, spans):
    model = RowWise()
    sampler = torch.nn.Module()
    sampler.forward = lambda logits: logits.float().argmax(dim=-1)
    hook = stagetrace_torch.record_decode(sampler, inputs=False)
    with torch.no_grad(), _root("ids") as req, stagetrace_torch.serving(req):
        tokens = [sampler(model(torch.tensor([5]))) for _ in range(2)]
    hook.remove()
    assert stagetrace.flush(5_000)
    decode = _stages(spans)[("ids", "decode")]
    assert "stagetrace.stage.input_digest" not in decode
    assert decode["stagetrace.stage.output_digest"] == digest([digest(t) for t in tokens])


def test_nothing_is_recorded_outside_serving_and_remove_restores_torch(tmp_path, spans):
    original = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        recording = stagetrace_torch.record_collectives()
        assert stagetrace_torch.record_collectives() is recording  # once, however often it is turned on
        assert dist.all_reduce is not original
        values = torch.ones(4)
        dist.all_reduce(values)  # outside serving: the collective runs, nothing is recorded
        assert values.tolist() == [1.0] * 4 and spans.get_finished_spans() == ()
        with _root("async") as req, stagetrace_torch.serving(req):
            dist.all_reduce(values, async_op=True).wait()
        recording.remove()
        assert dist.all_reduce is original
    finally:
        dist.destroy_process_group()
    stage = _stages(spans)[("async", "allreduce")]
    assert stage["allreduce.count"] == 1 and "stagetrace.stage.input_digest" in stage
    assert "async_op=True" in stage[completion.DIGEST_ERROR]


@pytest.mark.parametrize(
    "requests, error, says",
    [
        ([("not a request", 0)], TypeError, "serving() takes a request"),
        (42, TypeError, "serving() takes a request"),
        ([], ValueError, "at least one request"),
        ([({}, slice(2, None))], ValueError, "a stop and step 1"),
        ([({}, [-1])], ValueError, "numbered from 0"),
        ([({}, "rows")], ValueError, "rows must be"),
    ],
)
def test_bad_batches_are_one_line_errors(requests, error, says):
    with pytest.raises(error) as raised:
        stagetrace_torch.serving(requests)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_record_decode_needs_a_module():
    with pytest.raises(TypeError, match="needs a torch.nn.Module, not function"):
        stagetrace_torch.record_decode(lambda x: x)
