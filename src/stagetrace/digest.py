"""Content digests: BLAKE2b-128 over a canonical, type-tagged encoding.

Equal content gives equal digests across processes, machines and Python versions: dict order does
not matter, ``1``, ``1.0``, ``True`` and ``"1"`` all differ, and every value is length-prefixed so
no two structures encode to the same bytes.

Arrays and tensors (NumPy, torch on any device, CuPy, JAX, anything with ``__dlpack__`` or
``__cuda_array_interface__``) are content by dtype, shape and bytes, through one 128-bit hash that the host and
the device compute alike (``stagetrace.tensors``); a device tensor is hashed on its device and ``digest`` waits
for it (the span API does not: it completes the span when the digest is ready). ``Folded`` and ``Steps`` fold
several such digests, ready or not, into one value of a span.

The frame every digest ends in is ``stagetrace.frames``'; ``stagetrace.tensors`` frames arrays with it, and is
imported here only when an array is met.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from stagetrace.conventions import STEP_DIGEST_CHARS, STEPS_KEPT
from stagetrace.frames import DIGEST_BYTES, framed  # noqa: F401  (framed: part of this module's interface)
from stagetrace.frames import frame as _frame


def digest(value) -> str:
    """The hex digest (32 characters) of ``value``'s canonical encoding."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, value)
    return h.hexdigest()


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


class Folded:
    """The digest of several digests in order (``digest([d1, d2, ...])``): a stage's content over many tensors.
    ``parts`` are digests that may not be ready yet (``stagetrace.tensors``' ``Ready``, ``Pending``, ``Later``,
    ``Failed``): ``done()`` when all are, ``result()`` raises what a failed part raises."""

    def __init__(self, parts: list):
        self.parts = parts

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def result(self) -> str:
        return digest([p.result() for p in self.parts])


class Steps(Folded):
    """The first ``STEPS_KEPT`` parts' digests, each cut to ``STEP_DIGEST_CHARS``, comma-separated, in order
    (``conventions.STAGE_STEP_INPUT_DIGESTS``)."""

    def __init__(self, parts: list):
        super().__init__(parts[:STEPS_KEPT])

    def result(self) -> str:
        return ",".join(p.result()[:STEP_DIGEST_CHARS] for p in self.parts)
