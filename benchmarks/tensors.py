"""Tensors as stage content, on the CPU: host time per recorded tensor and digest throughput of the array hash
(``stagetrace.tensors``), side by side with today's way round for a bfloat16 tensor, ``.float().cpu().numpy()``
then the release before's array digest (BLAKE2b over dtype, shape and every byte), on the same tensors.

The shapes are the issue's: token IDs, a decode step's hidden state, logits, and (full run) a 134 MB KV block.
Also the hash's torch-ops path (what runs on a GPU) run on the CPU, for its cost in passes over memory. GPU
figures come from ``scripts/tensor-check`` on a GPU machine, not from here.
"""

from __future__ import annotations

import hashlib
import statistics
import struct

from benchmarks import Figure, benchmark, median_seconds

SHAPES = {  # name -> (shape, dtype name): the tensors
    "token IDs (8,) int64": ((8,), "int64"),
    "hidden (8, 8192) bf16": ((8, 8192), "bfloat16"),
    "logits (8, 128256) fp32": ((8, 128256), "float32"),
    "KV block (2, 32, 8, 1024, 128) bf16": ((2, 32, 8, 1024, 128), "bfloat16"),
}


def _old_digest(array) -> str:
    """The release before's digest of a NumPy array: BLAKE2b-128 over tag, length, dtype, shape and the bytes."""
    data = array.tobytes(order="C")
    payload = f"{array.dtype.str}{tuple(array.shape)}".encode() + b"\0" + data
    h = hashlib.blake2b(digest_size=16)
    h.update(b"A" + struct.pack(">Q", len(payload)))
    h.update(payload)
    return h.hexdigest()


@benchmark("tensors")
def tensors_benchmark(quick: bool) -> list[Figure]:
    try:
        import torch
    except ImportError:  # stagetrace runs without torch; so does this benchmark, with nothing to measure
        return []
    from stagetrace import tensors

    names = list(SHAPES)[:3] if quick else list(SHAPES)
    runs = 3 if quick else 9
    generator = torch.Generator().manual_seed(0)
    figures = []
    for name in names:
        shape, dtype = SHAPES[name]
        tensor = (
            torch.randint(0, 128256, shape, generator=generator)
            if dtype == "int64"
            else torch.randn(shape, generator=generator).to(getattr(torch, dtype))
        )
        nbytes = tensor.numel() * tensor.element_size()
        repeat = max(1, min(2000, (1 << 22) // nbytes))  # small tensors: many per timing, so the clock resolves them
        ours = median_seconds(lambda: [tensors.start(tensor).result() for _ in range(repeat)], runs) / repeat
        old = median_seconds(lambda: [_old_digest(tensor.float().cpu().numpy()) for _ in range(repeat)], runs) / repeat
        unit, scale = ("µs", 1e6) if ours < 1e-3 else ("ms", 1e3)
        figures.append(
            Figure(
                f"host time per recorded tensor, {name} ({nbytes:,} B)",
                ours * scale,
                unit,
                ".float().cpu().numpy() + the release before's digest",
                old * scale,
            )
        )
    largest = SHAPES[names[-1]]
    tensor = torch.randn(largest[0], generator=generator).to(getattr(torch, largest[1]))
    nbytes = tensor.numel() * tensor.element_size()
    seconds = median_seconds(lambda: tensors.start(tensor).result(), runs)
    figures.append(Figure(f"digest throughput, {names[-1]}", nbytes / seconds / 1e9, "GB/s"))
    words = tensors.torch_words(tensor.reshape(-1))
    device_path = median_seconds(lambda: tensors.device_lanes(words), runs)
    figures.append(
        Figure(
            f"torch-ops lanes (the GPU path) on the CPU, {names[-1]}",
            nbytes / device_path / 1e9,
            "GB/s",
            "NumPy lanes (the host path)",
            nbytes / seconds / 1e9,
        )
    )
    return figures


class _DecodeModel:
    """A small decoder for the decode-loop figure: embedding, ``layers`` MLP blocks each followed by the
    tensor-parallel all-reduce (a gloo group of one rank: the real collective, the real hook), a vocabulary head
    (logits) and a greedy sampler, its own module so that token IDs can be what ``decode`` records."""

    def __init__(self, torch, hidden: int, vocab: int, layers: int):
        generator = torch.Generator().manual_seed(0)
        nn = torch.nn

        class Sampler(nn.Module):
            def forward(self, logits):
                return logits.argmax(dim=-1)

        self.torch = torch
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = [
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        ]
        for module in [self.embed, *self.blocks]:
            for parameter in module.parameters():
                parameter.data = torch.randn(parameter.shape, generator=generator) * parameter.shape[-1] ** -0.5
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.sampler = Sampler()

    def step(self, tokens):
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
            self.torch.distributed.all_reduce(hidden)
        return self.sampler(self.head(hidden))


@benchmark("decode")
def decode_loop_benchmark(quick: bool) -> list[Figure]:
    """A decode loop of a small model, 8 requests batched, each step's all-reduces and decode content recorded for
    each request's rows, against the same loop unrecorded, interleaved run by run (issue 39's ≤ 1% aim)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return []
    import contextlib
    import tempfile
    from pathlib import Path

    import stagetrace
    from opentelemetry.sdk.trace import TracerProvider
    from stagetrace.integrations import pytorch as stagetrace_torch

    hidden, vocab, layers, steps, runs = (256, 8192, 2, 8, 3) if quick else (1024, 32000, 4, 64, 15)
    batch = 8
    torch.manual_seed(0)
    stagetrace.configure(tracer_provider=TracerProvider())  # spans made and ended as in service, exported nowhere
    figures = []
    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group("gloo", init_method=f"file://{Path(scratch) / 'rendezvous'}", rank=0, world_size=1)
        recording = stagetrace_torch.record_collectives()
        try:
            model = _DecodeModel(torch, hidden, vocab, layers)
            first = torch.randint(0, vocab, (batch,))

            def loop(recorded: bool):
                requests = [stagetrace.request(f"bench-{i}") for i in range(batch)]  # both loops' requests traced
                for req in requests:
                    req.__enter__()
                serving = stagetrace_torch.serving([(req, i) for i, req in enumerate(requests)])
                tokens = first
                with torch.no_grad(), serving if recorded else contextlib.nullcontext():
                    for _ in range(steps):
                        tokens = model.step(tokens)
                for req in reversed(requests):
                    req.__exit__(None, None, None)

            for content, module, inputs in (
                ("its input and the logits", model.head, True),
                ("the token IDs only", model.sampler, False),
            ):
                hook = stagetrace_torch.record_decode(module, inputs=inputs)
                loop(True), loop(False)  # warm both paths
                on, off = [], []
                for _ in range(runs):
                    on.append(median_seconds(lambda: loop(True), 1, warmup=0))
                    off.append(median_seconds(lambda: loop(False), 1, warmup=0))
                hook.remove()
                per_step = 1e3 / steps
                figures.append(
                    Figure(
                        f"decode loop, {layers} layers × {hidden} hidden, vocabulary {vocab:,}, batch {batch} (a request "
                        f"a row), per step: all-reduces and decode ({content}) recorded",
                        statistics.median(on) * per_step,
                        "ms",
                        "the same loop unrecorded",
                        statistics.median(off) * per_step,
                    )
                )
        finally:
            recording.remove()
            dist.destroy_process_group()
            stagetrace.shutdown()
    return figures
