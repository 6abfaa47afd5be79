"""An array's digest: ``Ready`` now (the host), ``Pending`` on its device, or ``Failed``; the 16 bytes of lanes, the
dtype's name and the shape go through the BLAKE2b frame every value's digest ends in (tag ``X``).

**On a GPU** (``start``): the first step (``w * M1``) runs on the producer's stream, so it reads the tensor as of that
point in the stream and leaves a private copy that the caller may overwrite or free after; the rest runs on a side
stream that waits for it, the 16 bytes are copied without blocking into pinned memory and a CUDA event marks them
ready. Nothing synchronises the caller's stream or thread; the result is read when the event says so
(``Pending.done``), by the span completer (``stagetrace.completion``).
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from stagetrace.frames import framed
from stagetrace.tensors.arrays import as_tensor_or_array, described, flat, host_bytes, storage_problem, torch_dtype_name
from stagetrace.tensors.lanes import device_lanes, host_lanes, host_words, lane_ints, premultiplied, torch_words

TAG = b"X"


def payload(name: str, shape, lanes: tuple[int, int]) -> bytes:
    """What goes into the BLAKE2b frame: ``name(shape)``, a zero byte, A and B as 8 little-endian bytes each."""
    return _meta(name, tuple(shape)) + lanes[0].to_bytes(8, "little") + lanes[1].to_bytes(8, "little")


@functools.lru_cache(maxsize=1024)
def _meta(name: str, shape: tuple) -> bytes:  # a decode loop digests the same few shapes at every step
    return f"{name}{tuple(int(d) for d in shape)}".encode() + b"\0"


class Ready:
    """A digest known now (``payload``: its frame's payload, for digests nested in other values)."""

    def __init__(self, value: str, payload_bytes: bytes | None = None):
        self._value, self._payload = value, payload_bytes

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float | None = None) -> str:
        return self._value

    def payload(self, timeout_s: float | None = None) -> bytes:
        return self._payload


class Failed:
    """A digest that could not be computed; ``result`` raises DigestUnavailable with the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float | None = None):
        raise DigestUnavailable(self.reason)

    payload = result


class DigestUnavailable(RuntimeError):
    """A tensor's digest could not be computed (a CUDA error, its storage freed, the process exiting)."""


def wait_until(done, timeout_s: float | None) -> None:
    """Poll ``done()`` (a CUDA event's query: never a blocking wait) with a growing pause, until it is true."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 20e-6
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise DigestUnavailable(f"the device had not finished the digest after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class Pending:
    """A tensor's digest being computed on its device: ``done()`` polls its CUDA event without blocking;
    ``result()`` waits for it (only the calling thread), then returns the hex digest."""

    def __init__(self, name: str, shape, host_lanes_buffer, ready, keep):
        self._name, self._shape = name, tuple(shape)
        self._host, self._ready, self._keep = host_lanes_buffer, ready, keep
        self._value: str | None = None
        self._payload: bytes | None = None
        self._error: str | None = None
        self._lock = threading.Lock()  # the completer and a caller of result() may both poll

    def done(self) -> bool:
        with self._lock:
            if self._value is not None or self._error is not None:
                return True
            try:
                if not self._ready.query():
                    return False
                lanes = lane_ints(self._host.tolist())  # pinned host memory: no device access
                self._payload = payload(self._name, self._shape, lanes)
                self._value = framed(TAG, self._payload)
            except Exception as exc:  # a CUDA error raised by the query: the span says so
                self._error = f"the device failed before the digest was ready ({described(exc)})"
            self._keep = self._host = None  # the private copy and the lanes may go back to the allocator now
            return True

    def result(self, timeout_s: float | None = None) -> str:
        wait_until(self.done, timeout_s)
        if self._error is not None:
            raise DigestUnavailable(self._error)
        return self._value

    def payload(self, timeout_s: float | None = None) -> bytes:
        self.result(timeout_s)
        return self._payload


def start(value):
    """Begin digesting an array: ``Ready`` (host arrays, computed now), ``Pending`` (a CUDA tensor, hashed on its
    device without synchronising) or ``Failed`` (its bytes could not be read). TypeError/ValueError for what cannot
    be digested at all."""
    array = as_tensor_or_array(value)
    if isinstance(array, np.ndarray):
        return _ready(host_payload(array))
    tensor = array
    problem = storage_problem(tensor)
    if problem is not None:
        return Failed(f"cannot digest the tensor: {problem}")
    if tensor.device.type == "cpu":
        return _ready(host_payload(tensor))
    if tensor.numel() == 0:
        return _ready(payload(torch_dtype_name(tensor.dtype), tensor.shape, (0, 0)))
    try:
        if tensor.device.type == "cuda":
            return _start_cuda(tensor)
        lanes = device_lanes(torch_words(flat(tensor))).cpu()  # other devices: synchronously, on the device
        return _ready(payload(torch_dtype_name(tensor.dtype), tensor.shape, lane_ints(lanes.tolist())))
    except TypeError:
        raise
    except Exception as exc:  # a device error: the span records it instead of the digest
        return Failed(f"the device failed while digesting the tensor ({described(exc)})")


def payload_now(value) -> bytes:
    """The frame payload of an array, waiting for a device (``digest`` of a tensor; the span API uses ``start``)."""
    return start(value).payload()


def _ready(payload_bytes: bytes) -> Ready:
    return Ready(framed(TAG, payload_bytes), payload_bytes)


def host_payload(array) -> bytes:
    """The frame payload of a NumPy array or a CPU tensor (hashed here, now)."""
    name, shape, data = host_bytes(array)
    return payload(name, shape, host_lanes(host_words(data)))


_side_streams: dict = {}
_side_lock = threading.Lock()


def side_stream(device):
    """The stream a device's digests are hashed on, one per device, made when first asked for."""
    import torch

    with _side_lock:
        stream = _side_streams.get(device.index)
        if stream is None:
            stream = _side_streams[device.index] = torch.cuda.Stream(device=device)
        return stream


def _start_cuda(tensor) -> Pending:
    import torch

    producer = torch.cuda.current_stream(tensor.device)
    # On the producer's stream, in its order: reads the tensor as of now into a private buffer (w * M1, the
    # hash's first step), so the caller may overwrite or free the tensor as soon as this returns.
    private = premultiplied(torch_words(flat(tensor)))
    side = side_stream(tensor.device)
    side.wait_stream(producer)  # an event between the streams: the host does not wait
    with torch.cuda.stream(side):
        lanes = device_lanes(private, premultiplied=True)
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(lanes, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    private.record_stream(side)  # the allocator may not hand it to the producer's stream before the side is done
    return Pending(torch_dtype_name(tensor.dtype), tensor.shape, host, ready, (private, lanes))
