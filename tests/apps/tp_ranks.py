"""One rank of a tensor-parallel gloo job whose process stands for a host of its own: the job of
``tests/test_rank_localization.py``. The model is ``tp_model.py``'s (a small random-weight LM, ``all_reduce`` per
layer, recorded by stagetrace's PyTorch integration); what differs is where each rank says it runs and how a
request corrupts a shard.

    python tp_ranks.py RANK WORLD_SIZE MASTER_PORT OTLP_TRACES_URL JOB_JSON

JOB_JSON: ``{"service": ..., "hosts": "prefix", "precision": {"R": "medium"} or absent, "requests": [{"id",
"prompt", "tokens", "logprobs": bool or absent, "corrupt": {"rank": R, "scale": S} or absent}, ...]}``. Rank R's
process has resource ``host.name`` ``{prefix}-node-R`` and ``gpu.uuid`` ``GPU-{prefix}-R``, and records its
``torch.float32_matmul_precision``: ``precision`` sets it per rank (a process launched with another numerics
setting; ``tp_model`` then computes that rank's partial products in bfloat16, as "medium" lets a GPU do). On the
request's corrupted rank one weight of its shard is multiplied by ``scale`` for that request only (256: one exponent
bit, a silent corruption that changes the output; a factor a few ulps from 1: one that changes the contribution's
bits and, after argmax, usually not the output). Rank 0 prints ``{request ID: generated token IDs}`` as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

sys.path.insert(0, str(Path(__file__).parent))
from tp_model import TinyLM, finish, serve  # noqa: E402

import stagetrace  # noqa: E402
from stagetrace.integrations import pytorch as stagetrace_torch  # noqa: E402

PRECISION = "torch.float32_matmul_precision"  # the process's setting, as ``torch.get_float32_matmul_precision`` says


def main(rank: int, world: int, port: int, otlp_url: str, job: dict) -> None:
    prefix = job["hosts"]
    torch.set_float32_matmul_precision(job.get("precision", {}).get(str(rank), "highest"))
    resource = Resource.create(
        {
            "service.name": job["service"],
            "host.name": f"{prefix}-node-{rank}",
            "gpu.uuid": f"GPU-{prefix}-{rank}",
            PRECISION: torch.get_float32_matmul_precision(),
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url)))
    stagetrace.configure(tracer_provider=provider)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    model = TinyLM(rank, world).eval()
    stagetrace_torch.record_collectives()  # the two lines that record the per-rank collectives and decode
    stagetrace_torch.record_decode(model.lm_head)

    outputs = {}
    with torch.no_grad():
        for request in job["requests"]:
            corrupt = request.get("corrupt") or {}
            weight = model.layers[0].down
            kept = weight[1, 0].clone()
            if corrupt.get("rank") == rank:
                weight[1, 0] *= corrupt["scale"]
            outputs[request["id"]] = serve(model, request, rank)
            weight[1, 0] = kept
    finish(provider, rank, outputs)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
