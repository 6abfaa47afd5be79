"""The rank that broke it: a tensor-parallel rank whose contribution to the all-reduce is corrupted is named, with
its GPU and host, not the rank that carries the request or the ranks that summed the corrupted contribution.

The class of case: silent data corruption in tensor parallelism. One rank computes with a corrupted weight of its
shard; the all-reduce adds its wrong partial sum into every rank's result, so every rank's output differs and only
the inputs tell the ranks apart. Two real gloo jobs (``tests/apps/tp_ranks.py``: ``torch.distributed`` with a
process per rank, each process a host of its own with its own ``host.name`` and ``gpu.uuid``), instrumented with
stagetrace's PyTorch integration, send their spans with the official OTLP exporter into one real embedded store:

- ``lm-tp2``: TP = 2; rank 1 corrupts some requests (always the same weight: a faulty GPU).
- ``lm-tp4``: TP = 4, the other's neighbour in the store; rank 2 corrupts some requests and, at the same time,
  rank 0 (the rank that carries the request) others; a masked corruption on rank 1 just before one of rank 2's
  makes that request's baseline carry a difference of its own (against it alone, ranks 1 and 2 began it).

- ``lm-prec``: TP = 2 on two groups of hosts, outputs with their logprobs; rank 1 of group b runs with float32
  matmuls at "medium" precision (bfloat16 inside, done by hand: on a CPU the setting does not change the kernels),
  recorded on its resource as ``torch.float32_matmul_precision``; beside it group a's rank 0 corrupts a shard.

- ``hand-tp2``: TP = 2 recorded by hand with the span API (one input and output digest per rank, no step digests),
  two groups of two hosts; rank 1 of group b corrupts two requests, and during one of them its host's NIC counts
  packet sequence errors (the hardware samples are written in the agent's metric format: no mlx5 NIC here).

Each job also serves control requests and masked ones (a corruption too small to change the generated tokens).
Which request deviates is decided by the models' own outputs, never by the analysis. Every case goes through
``explain``, ``divergences`` and the live analyser, which must give the same rank, GPU and host. Real hosts' GPUs
do not exist here: the GPU UUIDs are the processes' resource attributes, as the resource detector records them.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from stagetrace.analysis import divergences, live, population
from stagetrace import lookup
from stagetrace.analysis.comparison import compare_stages, first_divergence
from stagetrace.analysis.explain import Explainer
from stagetrace.dashboards import divergences as explorer
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.store import open_store
from tests.grafana_macros import ALL, QueryContext, Variable, expand

APP = Path(__file__).parent / "apps" / "tp_ranks.py"
FLIP = 256.0  # one exponent bit of one weight: changes the output
ULP = 1.0 + 2.0**-20  # a few ulps: changes the contribution's bits, not the generated tokens
TOKENS = 3
PROMPTS = {"a": [5, 17, 42], "b": [1, 2, 3]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(service: str, faults: dict[str, tuple[int, float]]) -> dict:
    """Per prompt: three controls, then each fault's requests (``faults``: request-ID infix -> (rank, scale)), the
    controls first so that the majority is theirs."""
    requests = []
    for p, prompt in PROMPTS.items():
        requests += [{"id": f"{service}-{p}-ok{i}", "prompt": prompt, "tokens": TOKENS} for i in range(3)]
        for name, (rank, scale) in faults.items():
            requests += [
                {
                    "id": f"{service}-{p}-{name}",
                    "prompt": prompt,
                    "tokens": TOKENS,
                    "corrupt": {"rank": rank, "scale": scale},
                }
            ]
    return {"service": service, "hosts": service, "requests": requests}


JOBS = {
    "lm-tp2": (2, _plan("lm-tp2", {"r1": (1, FLIP), "r1again": (1, FLIP), "masked": (1, ULP)})),
    # the masked corruption (rank 1) just before r2late: that request's nearest agreeing baseline carries it
    "lm-tp4": (
        4,
        _plan(
            "lm-tp4",
            {"r2": (2, FLIP), "r2again": (2, FLIP), "r0": (0, FLIP**2), "masked": (1, ULP), "r2late": (2, FLIP)},
        ),
    ),
}

# ``lm-prec``: TP = 2 on two groups of hosts, every request with its logprobs (so that any difference in the last bit
# shows in the output). Group a serves each prompt three times and, beside them, once with a corrupted shard on rank 0
# (another fault at the same time, in the same service); group b twice, its rank 1's process launched with float32
# matmuls at "medium" precision (bfloat16 inside), the setting recorded on its resource.
NUMERICS = "lm-prec"
PRECISION = "torch.float32_matmul_precision"
NUMERICS_PROMPTS = {"a": [5, 17, 42], "b": [1, 2, 3], "c": [9, 30, 60]}
NUMERICS_JOBS = [
    {
        "service": NUMERICS,
        "hosts": f"{NUMERICS}-a",
        "requests": [
            {
                "id": f"{NUMERICS}-{p}-{kind}",
                "prompt": prompt,
                "tokens": TOKENS,
                "logprobs": True,
                **({"corrupt": {"rank": 0, "scale": FLIP}} if kind == "r0" else {}),
            }
            for p, prompt in NUMERICS_PROMPTS.items()
            for kind in ("ok0", "ok1", "ok2", "r0")
        ],
    },
    {
        "service": NUMERICS,
        "hosts": f"{NUMERICS}-b",
        "precision": {"1": "medium"},
        "requests": [
            {"id": f"{NUMERICS}-{p}-medium{i}", "prompt": prompt, "tokens": TOKENS, "logprobs": True}
            for p, prompt in NUMERICS_PROMPTS.items()
            for i in range(2)
        ],
    },
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(store, {request ID: generated tokens}) of both jobs, run at once into one store."""
    with open_store(f"chdb://{tmp_path_factory.mktemp('ranks') / 'store'}") as store:
        receiver = OtlpReceiver(store, "127.0.0.1:0")
        try:
            processes = {}
            jobs = [(service, world, plan) for service, (world, plan) in JOBS.items()]
            jobs += [(plan["hosts"], 2, plan) for plan in NUMERICS_JOBS]
            for name, world, plan in jobs:
                port = _free_port()
                processes[name] = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(APP),
                            str(rank),
                            str(world),
                            str(port),
                            f"{receiver.url}/v1/traces",
                            json.dumps(plan),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for rank in range(world)
                ]
            outputs = {}
            for name, ranks in processes.items():
                results = [p.communicate(timeout=300) for p in ranks]
                for p, (_, err) in zip(ranks, results):
                    assert p.returncode == 0, err
                outputs.update(json.loads(results[0][0]))
            assert receiver.writer.flush()
        finally:
            receiver.close()
        _record_by_hand(store)
        yield store, outputs


BY_HAND = {"hand-nic": 6, "hand-quiet": 10}  # request ID -> its index: rank 1 of group b corrupted
NIC_LABELS = {"device": "mlx5_0", "port": "1"}


def _record_by_hand(store) -> None:
    """``hand-tp2``: a request every 20 s for 16 requests, two prompts, alternating between group a (hosts hand-a0,
    hand-a1) and group b (hand-b0, hand-b1). Each rank's allreduce span: input its partial sum, output the reduced
    sum. Rank 1 of group b contributes a corrupted partial to ``BY_HAND``'s requests; hand-b1's NIC counts sequence
    errors during the first one only."""
    from opentelemetry import trace as otel
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stagetrace import conventions as cv
    from stagetrace.digest import digest
    from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
    from tests.fleet import Fleet

    memory = InMemorySpanExporter()
    tracers = {}
    for host in ("hand-a0", "hand-a1", "hand-b0", "hand-b1"):
        provider = TracerProvider(
            resource=Resource.create({"service.name": "hand-tp2", "host.name": host, "gpu.uuid": f"GPU-{host}"})
        )
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracers[host] = provider.get_tracer("by-hand")
    t0 = time.time_ns() - 30 * 60 * 10**9
    corrupted = {i: rid for rid, i in BY_HAND.items()}
    starts = {}
    for i in range(16):
        at, prompt, group = t0 + i * 20 * 10**9, i % 2, "ab"[(i // 2) % 2]
        bad = i in corrupted
        assert not bad or group == "b"
        rid = corrupted.get(i, f"hand-{i:02d}")
        starts[rid] = at
        total = f"sum-{prompt}" + ("-bad" if bad else "")
        root = tracers[f"hand-{group}0"].start_span(
            "inference.request",
            start_time=at,
            attributes={
                cv.REQUEST_ID: rid,
                cv.INPUT_DIGEST: digest(f"prompt-{prompt}"),
                cv.OUTPUT_DIGEST: digest(total),
            },
        )
        context = otel.set_span_in_context(root)
        for rank in (0, 1):
            partial = f"partial-{prompt}-{rank}" + ("-bad" if bad and rank == 1 else "")
            span = tracers[f"hand-{group}{rank}"].start_span(
                "allreduce",
                context=context,
                start_time=at + 10**6,
                attributes={
                    cv.STAGE: "allreduce",
                    cv.TP_RANK: rank,
                    cv.TP_SIZE: 2,
                    "net.rdma.devices": ["mlx5_0"],
                    cv.STAGE_INPUT_DIGEST: digest(partial),
                    cv.STAGE_OUTPUT_DIGEST: digest(total),
                },
            )
            span.end(end_time=at + 5 * 10**6)
        root.end(end_time=at + 10 * 10**6)
    writer = ClickHouseSpanExporter(store=store, spool_dir=False, create_schema=False)
    assert writer.export(memory.get_finished_spans()).name == "SUCCESS" and writer.force_flush(60_000)
    writer.shutdown()
    fleet = Fleet(store)
    for host in tracers:  # scraped every 15 s all along; hand-b1's counter rises once, in the scrape after hand-nic
        rises = ((starts["hand-nic"] + 12 * 10**9, 3.0),) if host == "hand-b1" else ()
        fleet.counter(
            host, "rdma_packet_seq_err_total", NIC_LABELS, t0 - 60 * 10**9, t0 + 7 * 60 * 10**9, value=40, rises=rises
        )


def test_ranks_recorded_by_hand_name_the_host_whose_nic_counted_errors_during_the_all_reduce(recorded):
    """With one input digest per rank and no steps, the rank whose contribution differs while the other's matches
    began it; its host's NIC counter is the evidence, never the summing rank's host (the root's)."""
    store, _ = recorded
    report = Explainer(store).explain("hand-nic").to_json()
    assert report["divergent_ranks"] == ["1"] and report["origin"]["how"] == "input", report["summary"]
    top = report["causes"][0]
    assert (top["kind"], top["name"], top["host"], str(top["rank"])) == (
        "hardware",
        "rdma_packet_seq_err_total",
        "hand-b1",
        "1",
    ), report["causes"][:3]
    # where in the window it rose is said between the count and the rank (docs/explain.md, "Where in the window")
    assert re.search(
        r"rdma_packet_seq_err_total rose by 3 .*allreduce.* on rank 1, mlx5_0 \(hand-b1\)", report["summary"]
    ), report["summary"]
    assert not any(c.get("host") == "hand-b0" or "hand-b0" in str(c.get("value")) for c in report["causes"])
    quiet = Explainer(store).explain("hand-quiet").to_json()
    assert quiet["divergent_ranks"] == ["1"], quiet["summary"]
    assert "rank 1 (GPU-hand-b1, hand-b1): rank 1's contribution to the all-reduce differs" in quiet["summary"]
    assert not any(c["kind"] == "hardware" for c in quiet["causes"]), quiet["causes"]


def _ids(service: str, kind: str) -> list[str]:
    return [f"{service}-{p}-{kind}" for p in PROMPTS]


def test_the_premise_comes_from_the_models_own_outputs(recorded):
    """Not an analysis test: the corruptions changed the generated tokens, the masked ones and controls did not."""
    _, outputs = recorded
    for service, kinds in (("lm-tp2", ("r1", "r1again")), ("lm-tp4", ("r2", "r2again", "r0", "r2late"))):
        for p in PROMPTS:
            control = outputs[f"{service}-{p}-ok0"]
            assert outputs[f"{service}-{p}-ok1"] == outputs[f"{service}-{p}-ok2"] == control
            assert outputs[f"{service}-{p}-masked"] == control, "the masked corruption must leave the tokens alone"
            for kind in kinds:
                assert outputs[f"{service}-{p}-{kind}"] != control, (service, p, kind)


@pytest.mark.parametrize(
    "service, kinds, rank",
    [
        ("lm-tp2", ("r1", "r1again"), "1"),
        ("lm-tp4", ("r2", "r2again", "r2late"), "2"),
        ("lm-tp4", ("r0",), "0"),  # the rank that carries the request, named only when it is the one that began it
    ],
)
def test_explain_names_the_rank_gpu_and_host_whose_contribution_differed(recorded, service, kinds, rank):
    store, _ = recorded
    world = JOBS[service][0]
    others = [str(r) for r in range(world) if str(r) != rank]
    for kind in kinds:
        for rid in _ids(service, kind):
            report = Explainer(store).explain(rid).to_json()
            assert report["diverged"] and report["first_divergent_stage"] == "allreduce", report["summary"]
            assert report["divergent_ranks"] == [rank], report["summary"]
            origin = report["origin"]
            assert origin["how"] == "input" and origin["received"] == [str(r) for r in range(world)], origin
            place = {"rank": rank, "gpu": f"GPU-{service}-{rank}", "host": f"{service}-node-{rank}"}
            assert origin["places"] == [place], origin
            summary = report["summary"]
            assert f"rank {rank}'s contribution to the all-reduce differs (its input)" in summary, summary
            assert f"GPU-{service}-{rank}" in summary and f"{service}-node-{rank}" in summary, summary
            for other in others:  # the ranks that summed it are not blamed
                assert f"GPU-{service}-{other}" not in summary and f"{service}-node-{other} " not in summary, summary
                assert not any(
                    c.get("rank") == other or f"GPU-{service}-{other}" in json.dumps(c) for c in report["causes"]
                ), report["causes"]
            received = "ranks 0 and 1 both" if world == 2 else "ranks 0, 1, 2 and 3 all"
            assert f"{received} received the difference" in summary, summary


@pytest.mark.parametrize("service", list(JOBS))
def test_controls_and_masked_corruptions_agree(recorded, service):
    store, _ = recorded
    for rid in _ids(service, "ok1") + _ids(service, "masked"):
        report = Explainer(store).explain(rid).to_json()
        assert not report["diverged"], report["summary"]


def test_the_same_gpu_beginning_differences_with_no_counter_is_suspected_silent_data_corruption(recorded):
    """Rank 1 of lm-tp2 began the difference of four requests and nothing was recorded against its GPU: once the
    analyser has recorded them, ``explain`` says so plainly, with the GPU's UUID and host. Rank 0 of lm-tp4 began
    two: named, but not suspected of silent corruption on two requests' evidence."""
    store, _ = recorded
    divergences.find(store, 3600 * 10**9, time.time_ns() + 10**9, limit=None)  # the analyser's record
    report = Explainer(store).explain("lm-tp2-a-r1").to_json()
    assert "suspected silent data corruption: GPU-lm-tp2-1 (lm-tp2-node-1)" in report["summary"], report["summary"]
    top = report["causes"][0]
    assert (top["kind"], top["gpu"], top["host"], top["requests"]) == ("sdc", "GPU-lm-tp2-1", "lm-tp2-node-1", 4)
    single = Explainer(store).explain("lm-tp4-a-r0").to_json()
    assert "silent data corruption" not in single["summary"], single["summary"]


def _began(items: dict) -> dict[str, list[tuple[str, str, str]]]:
    return {rid: [(p["rank"], p["gpu"], p["host"]) for p in item["began"]] for rid, item in items.items()}


_BEGAN_ROWS = """
SELECT RequestId, (BeganRank, BeganGpu, BeganHost, HostName) FROM {db:Identifier}.stagetrace_divergences FINAL"""


def _began_rows(store) -> dict[str, tuple[str, str, str, str]]:
    return dict(store.client.query(_BEGAN_ROWS, parameters={"db": store.database}).result_rows)


def _stored_as_expected(store, expected: dict) -> None:
    """Each stored row carries the rank, GPU and host that began it; its HostName stays the request's host (the
    root's: rank 0's, or hand-b0 for group b), which the rank that began it does not share unless it is rank 0."""
    rows = _began_rows(store)
    assert {rid: rows[rid][:3] for rid in expected} == {rid: e[0] for rid, e in expected.items()}
    for rid, [(rank, _, host)] in expected.items():
        assert (rows[rid][3] == host) == (rank == "0"), (rid, rows[rid])


def _service(rid: str) -> str:
    return "hand-tp2" if rid in BY_HAND else rid.rsplit("-", 2)[0]


def _numerics(outputs: dict, kind: str) -> list[str]:
    """``lm-prec``'s requests of a kind (``medium0``...) whose output differs from their prompt's controls'."""
    return [
        rid
        for p in NUMERICS_PROMPTS
        for rid in [f"{NUMERICS}-{p}-{kind}"]
        if outputs[rid] != outputs[f"{NUMERICS}-{p}-ok0"]
    ]


def _names_the_setting_on_its_host(cause: dict, summary: str) -> bool:
    host = f"{NUMERICS}-b-node-1"
    return (
        (cause["kind"], cause["name"], cause["value"], cause["baseline_value"])
        == ("attribute", PRECISION, "medium", "highest")
        and cause.get("where", {}).get("host.name") == host
        and f"{host} runs {PRECISION} medium where its peers run highest" in summary
    )


def test_a_rank_launched_with_another_numerics_setting_is_named_with_that_setting_on_its_host(recorded):
    """Rank 1 of group b computes its partial products at "medium" float32 matmul precision: its contribution is
    unique to it, so the stage's contrast never counts its setting; weighed on rank 1's own spans (those that began a
    difference against the same rank of their peers), the setting separates them as well as the host and GPU do and
    is named first, on rank 1's host. The corrupted shard beside it (rank 0 of group a) is not blamed on it."""
    store, outputs = recorded
    for p in NUMERICS_PROMPTS:  # the premise, from the model's own outputs
        assert outputs[f"{NUMERICS}-{p}-ok1"] == outputs[f"{NUMERICS}-{p}-ok2"] == outputs[f"{NUMERICS}-{p}-ok0"]
    deviating = _numerics(outputs, "medium0") + _numerics(outputs, "medium1")
    assert len(deviating) >= 4, deviating
    named = 0
    for rid in deviating:
        report = Explainer(store).explain(rid).to_json()
        assert report["first_divergent_stage"] == "allreduce" and report["divergent_ranks"] == ["1"], report["summary"]
        place = {"rank": "1", "gpu": f"GPU-{NUMERICS}-b-1", "host": f"{NUMERICS}-b-node-1"}
        assert report["origin"]["places"] == [place], report["origin"]
        strong = [c for c in report["causes"] if not c["weak"]]
        named += bool(strong) and _names_the_setting_on_its_host(strong[0], report["summary"])
        # the identities that separate the same requests come after the setting, never before it
        identities = [i for i, c in enumerate(strong) if c["name"] in ("host.name", "gpu.uuid")]
        assert all(i > 0 for i in identities), strong
    assert named >= 0.95 * len(deviating), (named, len(deviating))
    for rid in _numerics(outputs, "r0"):  # the neighbour: rank 0's corrupted shard, not the setting of another rank
        report = Explainer(store).explain(rid).to_json()
        assert report["divergent_ranks"] == ["0"], report["summary"]
        assert PRECISION not in report["summary"] and not any(c["name"] == PRECISION for c in report["causes"])
    for rid in [f"{NUMERICS}-{p}-ok1" for p in NUMERICS_PROMPTS]:
        assert not Explainer(store).explain(rid).to_json()["diverged"]


def test_divergences_and_the_live_analyser_give_the_same_rank_gpu_and_host(recorded):
    store, outputs = recorded
    expected = {}
    for service, kinds, rank in (
        ("lm-tp2", ("r1", "r1again"), "1"),
        ("lm-tp4", ("r2", "r2again", "r0", "r2late"), None),
    ):
        for kind in kinds:
            r = rank or kind[1]
            for rid in _ids(service, kind):
                expected[rid] = [(r, f"GPU-{service}-{r}", f"{service}-node-{r}")]
    expected |= {rid: [("1", "GPU-hand-b1", "hand-b1")] for rid in BY_HAND}
    medium = _numerics(outputs, "medium0") + _numerics(outputs, "medium1")
    expected |= {rid: [("1", f"GPU-{NUMERICS}-b-1", f"{NUMERICS}-b-node-1")] for rid in medium}
    expected |= {rid: [("0", f"GPU-{NUMERICS}-a-0", f"{NUMERICS}-a-node-0")] for rid in _numerics(outputs, "r0")}
    found = divergences.find(store, 3600 * 10**9, time.time_ns() + 10**9, limit=None)
    items = {item["request_id"]: item for group in found["groups"] for item in group["deviating"]}
    assert _began(items) == expected
    for rid, item in items.items():  # the stored row carries the GPU (Devices) and the verdict names rank and host
        assert item["device"] == expected[rid][0][1] and expected[rid][0][2] in item["summary"], item
    # the rank launched with another numerics setting: that setting first, on its host, as explain names it
    named = [rid for rid in medium if _names_the_setting_on_its_host(items[rid]["top_cause"], items[rid]["summary"])]
    assert len(named) >= 0.95 * len(medium), [items[rid]["summary"] for rid in medium]
    on = Counter()  # the tally counts each line's requests by the GPU and host that began them
    for line in found["tally"]:
        on.update(line.get("began_on", {}))
    assert on == Counter(f"{e[0][1]} ({e[0][2]})" for e in expected.values()), found["tally"]
    rows = dict(
        store.client.query(
            "SELECT RequestId, Devices FROM {db:Identifier}.stagetrace_divergences FINAL",
            parameters={"db": store.database},
        ).result_rows
    )
    assert {rid: rows[rid] for rid in expected} == {rid: e[0][1] for rid, e in expected.items()}
    _stored_as_expected(store, expected)
    assert all(row[:3] == ("", "", "") for rid, row in _began_rows(store).items() if rid not in expected)
    _the_dashboard_shows_each_gpu_that_began_differences(store, expected)

    store.client.command("TRUNCATE TABLE {db:Identifier}.stagetrace_divergences", parameters={"db": store.database})
    analyser = live.Analyser(
        store, live.Schedule(every_s=60, settle_s=0, lookback_s=3600), clock=lambda: time.time_ns() + 10**9
    )
    assert analyser.step() is not None
    summaries = dict(
        store.client.query(
            "SELECT RequestId, Summary FROM {db:Identifier}.stagetrace_divergences FINAL",
            parameters={"db": store.database},
        ).result_rows
    )
    assert sorted(summaries) == sorted(expected)
    _stored_as_expected(store, expected)
    tops = dict(
        store.client.query(
            "SELECT RequestId, (FirstDivergentStage, TopCauseName) FROM {db:Identifier}.stagetrace_divergences FINAL",
            parameters={"db": store.database},
        ).result_rows
    )
    assert [rid for rid in medium if tops[rid] == ("allreduce", PRECISION)] == [rid for rid in named]
    # /metrics: one series per (service, stage, rank, GPU, its host), counting the requests that rank began
    assert analyser.stats.began == Counter((_service(rid), "allreduce", *e[0]) for rid, e in expected.items())
    families = {f.name: f for f in analyser.stats.families("analyser-host")}
    began = {
        tuple(s.labels[k] for k in ("rank", "gpu", "gpu_host")): s.value
        for s in families["stagetrace_deviations_began"].samples
        if s.name.endswith("_total")
    }
    assert began == dict(Counter(e[0] for e in expected.values())), began
    for rid, [(rank, gpu, host)] in expected.items():
        assert f"rank {rank}'s contribution to the all-reduce differs" in summaries[rid] and gpu in summaries[rid]
        assert host in summaries[rid], summaries[rid]


def _the_dashboard_shows_each_gpu_that_began_differences(store, expected: dict) -> None:
    """The divergence explorer's "GPUs that began differences today", after the data source's rewrites: each GPU
    that began differences, with its host (not the request's) and the requests it touched."""
    now = datetime.now(timezone.utc) + timedelta(minutes=1)
    everything = {name: Variable((ALL,)) for name in ("service", "host", "stage")}
    sql = expand(explorer.BEGAN_TODAY_SQL, QueryContext(now - timedelta(hours=1), now), everything)
    store.client.database = store.database  # as the data source connects: its default database
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    names = [c["name"] for c in result["meta"]]
    shown = {
        (row["gpu"], row["host"]): (row["ranks"], int(row["requests"]))
        for row in (dict(zip(names, r)) for r in result["data"])
    }
    touched = Counter(e[0] for e in expected.values())
    assert shown == {(gpu, host): (rank, n) for (rank, gpu, host), n in touched.items()}, shown
    assert shown[("GPU-lm-tp2-1", "lm-tp2-node-1")] == ("1", 4)


def test_the_tallys_sql_finds_the_same_rank_gpu_and_host(recorded):
    """``population.first_differences`` (what the tally reads for requests not analysed in full) applies the same
    rule in SQL, with the confirmation against other majority requests: every deviation gets the rank, GPU and host
    ``explain`` names, those whose baseline carries a masked difference of its own on another rank (several ranks
    began it against the baseline alone) too."""
    store, _ = recorded
    until = time.time_ns() + 10**9
    t0 = until - 3600 * 10**9
    found = population.first_differences(store, t0, until, (t0 - 60 * 10**9, until + 60 * 10**9))
    deviations = {d.request_id: d for d in population.deviations(store, t0, until)}
    checked = confirmed = 0
    for rid, d in deviations.items():
        report = Explainer(store).explain(rid).to_json()
        if len(report["origin"]["ranks"]) != 1:
            continue
        place = report["origin"]["places"][0]
        # against its baseline alone (before the confirmation), several ranks began it, the lowest not the one
        # explain names: a masked difference on a lower rank of the baseline
        alone = first_divergence(
            compare_stages(lookup.by_request_id(store, rid), lookup.by_request_id(store, d.baseline_request_id))
        )
        confirmed += len(alone.ranks) > 1 and min(alone.ranks, key=int) != place["rank"]
        difference = found[d.trace_id]
        assert (difference.stage, difference.rank, difference.gpu, difference.host) == (
            "allreduce",
            place["rank"],
            place["gpu"],
            place["host"],
        ), (rid, alone.ranks)
        checked += 1
    assert checked == len(deviations) and confirmed >= 1, (checked, confirmed, len(deviations))
