"""Content digests: BLAKE2b-128 over a canonical, type-tagged encoding.

Equal content gives equal digests across processes, machines and Python versions: dict order does
not matter, ``1``, ``1.0``, ``True`` and ``"1"`` all differ, and every value is length-prefixed so
no two structures encode to the same bytes.

Arrays and tensors (NumPy, torch on any device, CuPy, JAX, anything with ``__dlpack__`` or
``__cuda_array_interface__``) are content by dtype, shape and bytes, through one 128-bit hash that the host and
the device compute alike (``stagetrace.tensors``); a device tensor is hashed on its device and ``digest`` waits
for it (the span API does not: it completes the span when the digest is ready).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct

DIGEST_BYTES = 16


def digest(value) -> str:
    """The hex digest (32 characters) of ``value``'s canonical encoding."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, value)
    return h.hexdigest()


def framed(tag: bytes, payload: bytes) -> str:
    """The hex digest of one frame: what ``digest`` gives for a value whose encoding is ``tag`` and ``payload``."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _frame(h, tag, payload)
    return h.hexdigest()


def _frame(h, tag: bytes, payload: bytes) -> None:
    h.update(tag)
    h.update(struct.pack(">Q", len(payload)))
    h.update(payload)


def _encoded(value) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, value)
    return h.digest()


def is_array(value) -> bool:
    """Whether ``value`` is digested as an array (``stagetrace.tensors``): NumPy, torch, DLPack, CUDA arrays."""
    # the attributes first: plain values never import NumPy or stagetrace.tensors
    if not (hasattr(value, "dtype") or hasattr(value, "__dlpack__") or hasattr(value, "__cuda_array_interface__")):
        return False
    from stagetrace import tensors

    return tensors.is_array(value)


def _feed(h, value) -> None:
    if value is None:
        _frame(h, b"N", b"")
    elif value is True or value is False:
        _frame(h, b"B", b"1" if value else b"0")
    elif isinstance(value, int):
        _frame(h, b"I", str(value).encode())
    elif isinstance(value, float):
        # repr is the shortest string that round-trips; all NaNs are one value
        _frame(h, b"F", b"nan" if math.isnan(value) else repr(value).encode())
    elif isinstance(value, str):
        _frame(h, b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _frame(h, b"Y", bytes(value))
    elif isinstance(value, (list, tuple)):
        _frame(h, b"L", b"".join(_encoded(v) for v in value))
    elif isinstance(value, dict):
        items = sorted(_encoded(k) + _encoded(v) for k, v in value.items())
        _frame(h, b"D", b"".join(items))
    elif isinstance(value, (set, frozenset)):
        _frame(h, b"T", b"".join(sorted(_encoded(v) for v in value)))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _frame(h, b"C", type(value).__qualname__.encode() + _encoded(dataclasses.asdict(value)))
    elif is_array(value):
        # NumPy arrays and scalars, tensors on any device: dtype, shape and a 128-bit hash of the bytes
        from stagetrace import tensors

        _frame(h, tensors.TAG, tensors.payload_now(value))
    else:
        raise TypeError(
            f"cannot digest a {type(value).__name__}: pass str, bytes, numbers, lists, dicts, "
            "dataclasses or arrays (or a digest you computed yourself)"
        )
