"""A small tensor-parallel language model (random weights) run as one rank of a gloo group, its all-reduce and decode
stages recorded by stagetrace's PyTorch integration and sent with the official OTLP/HTTP exporter: one process of
the two-rank job in ``tests/test_torch_stages.py``.

    python tp_model.py RANK WORLD_SIZE MASTER_PORT OTLP_TRACES_URL PLAN_JSON

PLAN_JSON: ``{"requests": [{"id": ..., "prompt": [token IDs], "tokens": N, "perturb_rank": R or null}, ...]}``.
Rank 0 opens each request and hands its ``traceparent`` carrier to the other ranks; every rank runs the request's
greedy decode loop inside ``serving``. On ``perturb_rank`` one weight of that rank's shard is changed for that
request only (a faulty GPU's view of its shard). Rank 0 prints ``{request ID: generated token IDs}`` as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import stagetrace
from stagetrace.integrations import pytorch as stagetrace_torch

VOCAB, HIDDEN, FFN, LAYERS = 64, 32, 64, 2


class ShardedMLP(torch.nn.Module):
    """One layer's MLP split across the ranks as Megatron splits it: the up projection by columns, the down
    projection by rows, so each rank holds a partial sum of the output and one all_reduce adds them."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.up, self.down = torch.nn.Parameter(up), torch.nn.Parameter(down)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.get_float32_matmul_precision() == "medium":
            # what "medium" lets a GPU's float32 matmuls do (compute in bfloat16), done here by hand: on a CPU the
            # setting does not change the kernels
            low = torch.nn.functional.gelu((hidden.bfloat16() @ self.up.bfloat16()).float())
            partial = (low.bfloat16() @ self.down.bfloat16()).float()
        else:
            partial = torch.nn.functional.gelu(hidden @ self.up) @ self.down
        dist.all_reduce(partial)  # looked up at call time: stagetrace's recording wrapper when turned on
        return hidden + partial


class TinyLM(torch.nn.Module):
    def __init__(self, rank: int, world: int):
        super().__init__()
        generator = torch.Generator().manual_seed(0)  # every rank draws the same full weights, then keeps its shard
        shard = slice(rank * FFN // world, (rank + 1) * FFN // world)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.data = torch.randn(VOCAB, HIDDEN, generator=generator)
        layers = []
        for _ in range(LAYERS):
            up = torch.randn(HIDDEN, FFN, generator=generator) / HIDDEN**0.5
            down = torch.randn(FFN, HIDDEN, generator=generator) / FFN**0.5
            layers.append(ShardedMLP(up[:, shard].contiguous(), down[shard].contiguous()))
        self.layers = torch.nn.ModuleList(layers)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight.data = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(hidden)


def generate(model: TinyLM, prompt: list[int], tokens: int, logprobs: bool = False) -> list:
    """The greedy continuation's token IDs; with ``logprobs``, each as [token, its log-probability] (what an API's
    ``logprobs`` returns: a difference in the last bit shows)."""
    sequence, scores = list(prompt), []
    for _ in range(tokens):
        logits = model(torch.tensor(sequence))
        sequence.append(int(logits[-1].argmax()))
        scores.append(float(torch.log_softmax(logits[-1], -1)[sequence[-1]]))
    generated = sequence[len(prompt) :]
    return [[t, s] for t, s in zip(generated, scores)] if logprobs else generated


def share(carrier: dict | None) -> dict:
    """Rank 0's carrier on every rank (a broadcast, which stagetrace does not record)."""
    box = [carrier]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve(model: TinyLM, request: dict, rank: int) -> list[int] | None:
    """One request on every rank: rank 0 opens it and shares its context, each rank generates under it; rank 0's
    output (the others': None)."""
    if rank != 0:
        with stagetrace_torch.serving(share(None)):
            generate(model, request["prompt"], request["tokens"], request.get("logprobs", False))
        return None
    content = {"prompt": request["prompt"], "tokens": request["tokens"]}
    with stagetrace.request(request["id"], input=content) as req:
        share(req.carrier())
        with stagetrace_torch.serving(req):
            output = generate(model, request["prompt"], request["tokens"], request.get("logprobs", False))
        req.set_output(output)
    return output


def finish(provider: TracerProvider, rank: int, outputs: dict) -> None:
    """Every rank done, its spans exported; rank 0 prints the outputs."""
    dist.barrier()
    assert stagetrace.flush(30_000), "spans not exported"
    provider.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(outputs))


def main(rank: int, world: int, port: int, otlp_url: str, plan: dict) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "tiny-lm", "host.name": f"node-{rank}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url)))
    stagetrace.configure(tracer_provider=provider)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    model = TinyLM(rank, world).eval()
    stagetrace_torch.record_collectives()
    stagetrace_torch.record_decode(model.lm_head)

    outputs = {}
    with torch.no_grad():
        for request in plan["requests"]:
            perturbed = request.get("perturb_rank") == rank
            if perturbed:
                model.layers[0].down[1, 0] *= 256.0  # one exponent bit of one weight: a classic silent corruption
            outputs[request["id"]] = serve(model, request, rank)
            if perturbed:
                model.layers[0].down[1, 0] /= 256.0
    finish(provider, rank, outputs)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
