"""Tensors as stage content, on the CPU: host time per recorded tensor and digest throughput of the array hash
(``stagetrace.tensors``), side by side with today's way round for a bfloat16 tensor, ``.float().cpu().numpy()``
then the release before's array digest (BLAKE2b over dtype, shape and every byte), on the same tensors.

The shapes are the issue's: token IDs, a decode step's hidden state, logits, and (full run) a 134 MB KV block.
Also the hash's torch-ops path (what runs on a GPU) run on the CPU, for its cost in passes over memory. GPU
figures come from ``scripts/tensor-check`` on a GPU machine, not from here.
"""

from __future__ import annotations

import hashlib
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
        tensor = (torch.randint(0, 128256, shape, generator=generator) if dtype == "int64"
                  else torch.randn(shape, generator=generator).to(getattr(torch, dtype)))  # fmt: skip
        nbytes = tensor.numel() * tensor.element_size()
        repeat = max(1, min(2000, (1 << 22) // nbytes))  # small tensors: many per timing, so the clock resolves them
        ours = median_seconds(lambda: [tensors.start(tensor).result() for _ in range(repeat)], runs) / repeat
        old = median_seconds(lambda: [_old_digest(tensor.float().cpu().numpy()) for _ in range(repeat)], runs) / repeat
        unit, scale = ("µs", 1e6) if ours < 1e-3 else ("ms", 1e3)
        figures.append(Figure(f"host time per recorded tensor, {name} ({nbytes:,} B)", ours * scale, unit,
                              ".float().cpu().numpy() + the release before's digest", old * scale))  # fmt: skip
    largest = SHAPES[names[-1]]
    tensor = torch.randn(largest[0], generator=generator).to(getattr(torch, largest[1]))
    nbytes = tensor.numel() * tensor.element_size()
    seconds = median_seconds(lambda: tensors.start(tensor).result(), runs)
    figures.append(Figure(f"digest throughput, {names[-1]}", nbytes / seconds / 1e9, "GB/s"))
    words = tensors.torch_words(tensor.reshape(-1))
    device_path = median_seconds(lambda: tensors.device_lanes(words), runs)
    figures.append(Figure(f"torch-ops lanes (the GPU path) on the CPU, {names[-1]}", nbytes / device_path / 1e9, "GB/s",
                          "NumPy lanes (the host path)", nbytes / seconds / 1e9))  # fmt: skip
    return figures
