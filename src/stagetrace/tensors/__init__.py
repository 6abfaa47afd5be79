"""Tensors as stage content: one array digest, computed with NumPy on the host or with torch ops on any device.

A tensor's content is its dtype, its shape and its bytes as stored, in C order (a non-contiguous view digests as its
contiguous copy, a big-endian NumPy array as its little-endian twin). Dtypes go by one name on every side ("float32",
"bfloat16", "float8_e4m3fn": torch's name without ``torch.``, NumPy's and ml_dtypes' ``dtype.name``), so a NumPy
array, a torch tensor on the CPU and the same tensor on a GPU have the same digest.

The package, by concern (every name below is importable from ``stagetrace.tensors``):

- ``lanes``: the hash itself, its definition and why it is safe to call two tensors equal by it;
- ``arrays``: what is an array, and its dtype name, shape and bytes;
- ``digests``: a digest started now (``start``): ``Ready``, ``Pending`` on a GPU, ``Failed``;
- ``rows``: groups of a batch's rows hashed in one pass, and many steps' tensors together (``RowBatches``), for the
  PyTorch integration.

``stagetrace.digest`` imports this package only when it meets an array.
"""

from __future__ import annotations

from stagetrace.tensors.arrays import as_tensor_or_array, is_array, numpy_dtype_name, storage_problem, torch_dtype_name
from stagetrace.tensors.digests import (
    TAG,
    DigestUnavailable,
    Failed,
    Pending,
    Ready,
    host_payload,
    payload,
    payload_now,
    start,
)
from stagetrace.tensors.lanes import (
    C1,
    C2,
    DEVICE_CHUNK_WORDS,
    HOST_CHUNK_WORDS,
    M1,
    M3,
    device_lanes,
    device_row_lanes,
    host_lanes,
    host_row_lanes,
    host_words,
    premultiplied,
    torch_words,
)
from stagetrace.tensors.rows import ROWS_PASS_WORDS, Later, RowBatches, row_bases, start_rows

__all__ = [
    "C1",
    "C2",
    "DEVICE_CHUNK_WORDS",
    "HOST_CHUNK_WORDS",
    "M1",
    "M3",
    "ROWS_PASS_WORDS",
    "TAG",
    "DigestUnavailable",
    "Failed",
    "Later",
    "Pending",
    "Ready",
    "RowBatches",
    "as_tensor_or_array",
    "device_lanes",
    "device_row_lanes",
    "host_lanes",
    "host_payload",
    "host_row_lanes",
    "host_words",
    "is_array",
    "numpy_dtype_name",
    "payload",
    "payload_now",
    "premultiplied",
    "row_bases",
    "start",
    "start_rows",
    "storage_problem",
    "torch_dtype_name",
    "torch_words",
]
