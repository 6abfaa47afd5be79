"""Tensors as stage content: one array digest, computed with NumPy on the host or with torch ops on any device.

A tensor's content is its dtype, its shape and its bytes as stored, in C order (a non-contiguous view digests as its
contiguous copy, a big-endian NumPy array as its little-endian twin). Dtypes go by one name on every side ("float32",
"bfloat16", "float8_e4m3fn": torch's name without ``torch.``, NumPy's and ml_dtypes' ``dtype.name``), so a NumPy
array, a torch tensor on the CPU and the same tensor on a GPU have the same digest.

**The hash ("lanes").** The bytes, zero-padded to a multiple of 8, are read as little-endian 64-bit words
``w_0 .. w_{n-1}``. With all arithmetic modulo 2**64 and ``>>>`` a logical shift::

    x_i = (w_i * M1) ^ i                    # the word's position enters every term: order matters
    x_i = fmix64(x_i)                       # MurmurHash3's finalizer: x ^= x >>> 33; x *= C1; x ^= x >>> 33;
                                            #                         x *= C2; x ^= x >>> 33
    y_i = x_i * M3;  y_i ^= y_i >>> 32
    A = sum(x_i),  B = sum(y_i)             # 128 bits: A and B, 8 bytes each, little-endian

(``M1``: the golden-ratio constant, ``M3``: SplitMix64's first multiplier, ``C1``, ``C2``: fmix64's; all odd.)
Each term depends on one word and its index, and addition modulo 2**64 is associative and commutative, so the sums
can be reduced in any order, in chunks, in parallel, on any device, and give the same bits: NumPy does it in
cache-sized chunks on the host, torch integer ops do it on the tensor's device (``device_lanes``), and only the 16
bytes cross to the host. The lanes, the dtype's name and the shape then go through the same BLAKE2b-128 frame as
every other value (tag ``X``), so a tensor's digest is type-tagged like the rest.

**Why it is safe enough to call two tensors equal.** For a fixed position every step is a bijection of the word
(multiplication by an odd constant, xor with a constant, xor-shift), so two tensors that differ in exactly one word
(one element of up to 8 bytes, one ulp, one sign) *always* get different ``A``. fmix64 flips each output bit with
probability 1/2 for any input bit (measured over 200,000 random words for every bit of the word and of the index:
no bias above sampling noise, and none between A's and B's terms), so tensors that differ in
more words collide only when both 64-bit sums agree by accident: about 2**-128 for data that was not built to
collide, far below the rate of the faults it is meant to find. The multiplication before the index is mixed in keeps
natural edits (two words swapped and each changed in its low bits) from mapping one tensor's terms onto another's.
It is **not cryptographic**: a sum of independent terms lets someone who wants a collision construct one, as with
any fast unkeyed hash. Equal elements in another order give other terms (their index differs), so a permutation is
other content, unlike ``torch.hash_tensor``, which XORs the elements and ignores their order.

**On a GPU** (``start``): the first step (``w * M1``) runs on the producer's stream, so it reads the tensor as of that
point in the stream and leaves a private copy that the caller may overwrite or free after; the rest runs on a side
stream that waits for it, the 16 bytes are copied without blocking into pinned memory and a CUDA event marks them
ready. Nothing synchronises the caller's stream or thread; the result is read when the event says so
(``Pending.done``), by the span completer (``stagetrace.completion``).
"""

from __future__ import annotations

import functools
import sys
import threading
import time

import numpy as np

from stagetrace.frames import framed

TAG = b"X"
M1, C1, C2, M3 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xBF58476D1CE4E5B9
HOST_CHUNK_WORDS = 1 << 15  # 256 KiB of words and two temporaries of that size stay in a core's L2 cache
ROWS_PASS_WORDS = 1 << 21  # a batch up to 16 MiB is split among its groups in one pass (two temporaries its size)
DEVICE_CHUNK_WORDS = 1 << 23  # 64 MiB temporaries on the device: a larger tensor is hashed in several chunks
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 scalar (torch has no unsigned 64-bit arithmetic: int64 wraps the same)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _C1, _C2, _M3 = _signed(M1), _signed(C1), _signed(C2), _signed(M3)
# torch's >> on int64 is arithmetic: masking the shifted value makes it the logical shift the definition uses
_LOW31, _LOW32 = (1 << 31) - 1, (1 << 32) - 1


# -- the hash, on the host
_M1_64, _C1_64, _C2_64, _M3_64 = np.uint64(M1), np.uint64(C1), np.uint64(C2), np.uint64(M3)
_S32, _S33 = np.uint64(32), np.uint64(33)
_INDEX = np.arange(HOST_CHUNK_WORDS, dtype=np.uint64)  # word indices of a chunk, made once


def _a_terms(words: np.ndarray, index: np.ndarray, x: np.ndarray, t: np.ndarray) -> None:
    """x <- fmix64((words * M1) ^ index), the terms of A; t is scratch (it may hold ``index``: read before reuse)."""
    np.multiply(words, _M1_64, out=x)
    np.bitwise_xor(x, index, out=x)
    for multiplier in (_C1_64, _C2_64, None):  # fmix64
        np.right_shift(x, _S33, out=t)
        np.bitwise_xor(x, t, out=x)
        if multiplier is not None:
            np.multiply(x, multiplier, out=x)


def _b_terms(x: np.ndarray, t: np.ndarray) -> None:
    """x (A's terms) <- B's terms, in place."""
    np.multiply(x, _M3_64, out=x)
    np.right_shift(x, _S32, out=t)
    np.bitwise_xor(x, t, out=x)


def host_lanes(words: np.ndarray, start: int = 0) -> tuple[int, int]:
    """(A, B) of little-endian uint64 ``words`` whose first word has index ``start``."""
    n = len(words)
    if n == 0:
        return 0, 0
    size = min(n, HOST_CHUNK_WORDS)
    x, t = np.empty(size, np.uint64), np.empty(size, np.uint64)  # reused by every chunk, in place
    a = b = 0
    for lo in range(0, n, size):
        k = min(n, lo + size) - lo
        xs, ts = x[:k], t[:k]
        index = np.add(_INDEX[:k], np.uint64(start + lo), out=ts) if start + lo else _INDEX[:k]
        _a_terms(words[lo : lo + k], index, xs, ts)
        a += int(xs.sum(dtype=np.uint64))  # NumPy's uint64 sum wraps modulo 2**64, as the definition does
        _b_terms(xs, ts)
        b += int(xs.sum(dtype=np.uint64))
    return a & _MASK64, b & _MASK64


def host_words(data: np.ndarray) -> np.ndarray:
    """The little-endian uint64 words of a C-contiguous uint8 array, zero-padded (a copy only when padding)."""
    if len(data) % 8:
        padded = np.zeros((len(data) + 7) // 8 * 8, np.uint8)
        padded[: len(data)] = data
        data = padded
    return data.view("<u8")


# -- the hash, with torch ops (any device; the same function, bit for bit)
def device_lanes(words, *, premultiplied: bool = False, chunk: int = DEVICE_CHUNK_WORDS):
    """(A, B) as an int64 tensor of 2 on ``words``' device, from int64 ``words`` (``w * M1`` already, when
    ``premultiplied``: then ``words`` is a private buffer and is overwritten)."""
    import torch

    n = words.numel()
    sums = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        x = words[lo:hi] if premultiplied else torch.mul(words[lo:hi], _M1)
        u = torch.arange(lo, hi, dtype=torch.int64, device=words.device)
        x.bitwise_xor_(u)
        t = torch.empty_like(x)
        _device_fmix_(x, t)
        sums.append(x.sum())  # int64 sums wrap modulo 2**64 on every device, in any reduction order
        torch.mul(x, _M3, out=t)
        torch.bitwise_right_shift(t, 32, out=u).bitwise_and_(_LOW32)
        sums.append(t.bitwise_xor_(u).sum())
    if not sums:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    lanes = torch.stack(sums)
    return lanes if len(sums) == 2 else lanes.view(-1, 2).sum(0)


def _device_fmix_(x, t) -> None:
    """x <- fmix64(x) in place, with torch ops (t: scratch of x's shape)."""
    import torch

    for multiplier in (_C1, _C2, None):
        torch.bitwise_right_shift(x, 33, out=t).bitwise_and_(_LOW31)
        x.bitwise_xor_(t)
        if multiplier is not None:
            x.mul_(multiplier)


def torch_words(flat):
    """int64 words of a contiguous 1-d tensor's bytes, zero-padded: a view when its bytes are whole, aligned words."""
    import torch

    data = flat.view(torch.uint8)
    if data.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if data.numel() % 8 or data.storage_offset() % 8:
        padded = torch.zeros((data.numel() + 7) // 8 * 8, dtype=torch.uint8, device=data.device)
        padded[: data.numel()].copy_(data)
        data = padded
    return data.view(torch.int64)


# -- what is an array, and its canonical name, shape and bytes
def _torch():
    return sys.modules.get("torch")


def is_array(value) -> bool:
    """Whether ``digest`` treats ``value`` as an array: NumPy, torch, DLPack, CUDA array interface, or NumPy-like."""
    if isinstance(value, (np.ndarray, np.generic)):
        return True
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    if isinstance(value, type):
        return False
    return (hasattr(value, "__dlpack__") or hasattr(value, "__cuda_array_interface__")
            or (hasattr(value, "dtype") and hasattr(value, "tobytes") and hasattr(value, "shape")))  # fmt: skip


def numpy_dtype_name(dtype: np.dtype) -> str:
    if dtype.kind == "O":
        raise TypeError("cannot digest an array of Python objects: digest its elements (a list) instead")
    if dtype.kind in "USV" and not dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.str.lstrip("<>|=")  # strings, bytes and records: the name alone does not say the item size
    return dtype.name  # bfloat16, float8_e4m3fn, ... from ml_dtypes as torch names them


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def payload(name: str, shape, lanes: tuple[int, int]) -> bytes:
    """What goes into the BLAKE2b frame: ``name(shape)``, a zero byte, A and B as 8 little-endian bytes each."""
    return _meta(name, tuple(shape)) + lanes[0].to_bytes(8, "little") + lanes[1].to_bytes(8, "little")


@functools.lru_cache(maxsize=1024)
def _meta(name: str, shape: tuple) -> bytes:  # a decode loop digests the same few shapes at every step
    return f"{name}{tuple(int(d) for d in shape)}".encode() + b"\0"


def _host_array(value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def as_tensor_or_array(value):
    """``value`` as a torch tensor (any device) or a NumPy array; TypeError, in one line, for what has no bytes."""
    if isinstance(value, (np.ndarray, np.generic)):
        return _host_array(value)
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return _checked(value)
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        on_host = int(value.__dlpack_device__()[0]) in (1, 3)  # kDLCPU, kDLCUDAHost
        torch = _import_torch(None if on_host else "a device array (DLPack)")
        if torch is not None:
            return _checked(torch.from_dlpack(value))
        try:
            return _host_array(np.from_dlpack(value))
        except (RuntimeError, TypeError, BufferError):
            return _host_array(value)  # bfloat16 and the float8 types: through the producer's own __array__
    if hasattr(value, "__cuda_array_interface__"):
        torch = _import_torch("a CUDA array (__cuda_array_interface__)")
        return _checked(torch.as_tensor(value, device="cuda"))
    return _host_array(value)


def _import_torch(needed_for: str | None):
    try:
        import torch
    except ImportError:
        if needed_for is None:
            return None
        raise TypeError(f"cannot digest {needed_for} without PyTorch: pip install torch") from None
    return torch


def _checked(tensor):
    """The tensor if its bytes can be read; TypeError or ValueError in one line if not."""
    import torch

    if tensor.is_meta or tensor.device.type == "meta":
        raise ValueError("cannot digest a tensor on the meta device: it has shape and dtype but no data")
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        raise TypeError(f"cannot digest a {layout} tensor: pass a dense one (tensor.to_dense())")
    if getattr(tensor, "is_nested", False):
        raise TypeError("cannot digest a nested tensor: digest its components (tensor.unbind()) instead")
    if tensor.is_quantized:
        raise TypeError("cannot digest a quantized tensor: pass tensor.int_repr() and its scale and zero point")
    return tensor.detach()


def storage_problem(tensor) -> str | None:
    """Why the tensor's bytes cannot be read now (its storage was freed or shrunk), or None."""
    if tensor.numel() == 0:
        return None
    try:
        have = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as exc:  # fake and functional tensors have no real storage
        return f"its storage cannot be read ({_one_line(exc)})"
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    need = (tensor.storage_offset() + extent) * tensor.element_size()
    if have < need:
        return f"its storage was freed or shrunk before it was digested ({have} of {need} bytes left)"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# -- digests: ready now (host), or pending on a device
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


def _wait_until(done, timeout_s: float | None) -> None:
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
                lanes = _lane_ints(self._host.tolist())  # pinned host memory: no device access
                self._payload = payload(self._name, self._shape, lanes)
                self._value = framed(TAG, self._payload)
            except Exception as exc:  # a CUDA error raised by the query: the span says so
                self._error = f"the device failed before the digest was ready ({_one_line(exc)})"
            self._keep = self._host = None  # the private copy and the lanes may go back to the allocator now
            return True

    def result(self, timeout_s: float | None = None) -> str:
        _wait_until(self.done, timeout_s)
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
        lanes = device_lanes(torch_words(_flat(tensor))).cpu()  # other devices: synchronously, on the device
        return _ready(payload(torch_dtype_name(tensor.dtype), tensor.shape, _lane_ints(lanes.tolist())))
    except TypeError:
        raise
    except Exception as exc:  # a device error: the span records it instead of the digest
        return Failed(f"the device failed while digesting the tensor ({_one_line(exc)})")


def payload_now(value) -> bytes:
    """The frame payload of an array, waiting for a device (``digest`` of a tensor; the span API uses ``start``)."""
    return start(value).payload()


def _ready(payload_bytes: bytes) -> Ready:
    return Ready(framed(TAG, payload_bytes), payload_bytes)


def host_payload(array) -> bytes:
    """The frame payload of a NumPy array or a CPU tensor (hashed here, now)."""
    name, shape, data = _host_bytes(array)
    return payload(name, shape, host_lanes(host_words(data)))


def _host_bytes(array) -> tuple[str, tuple, np.ndarray]:
    """A NumPy array's or a CPU tensor's dtype name, shape and bytes in C order (uint8, a view where it can be)."""
    if isinstance(array, np.ndarray):
        return numpy_dtype_name(array.dtype), array.shape, np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    import torch

    name, shape = torch_dtype_name(array.dtype), array.shape
    if array.numel() == 0:
        return name, shape, np.empty(0, np.uint8)
    return name, shape, _flat(array).view(torch.uint8).numpy()


# -- the rows of a batch, each group's own: start(batch[rows]) for every group, in one pass
#
# A group's rows, concatenated, are its content: the word at column c of the j-th of its rows has index
# j * row_words + c in it. So each row of the batch is hashed once with its own first index ("base"), its terms
# summed per row, and a group's lanes are the sums of its rows' (the terms depend on one word and its index only).
# Rows of many tensors of one layout (a decode loop's steps) are hashed the same way, end to end.


def row_bases(rows: int, row_words: int, groups: list[list[tuple[int, int]]]) -> np.ndarray:
    """Each row's first word index within its group's rows (uint64; 0 for a row of no group)."""
    bases = np.zeros(rows, np.uint64)
    for runs in groups:
        offset = 0
        for a, b in runs:
            if not 0 <= a < b <= rows:
                raise ValueError(f"rows {a}:{b} are not within the batch's {rows} rows")
            bases[a:b] = np.arange(offset, offset + (b - a) * row_words, row_words, dtype=np.uint64)
            offset += (b - a) * row_words
    return bases


@functools.lru_cache(maxsize=64)
def _columns(row_words: int) -> np.ndarray:
    return np.arange(row_words, dtype=np.uint64)


def host_row_lanes(words: np.ndarray, bases: np.ndarray) -> tuple[list[int], list[int]]:
    """(A, B) of each row of ``words`` (uint64, rows × row_words) whose first word has index ``bases[row]``."""
    x, t = np.empty_like(words), np.empty_like(words)
    np.add(bases[:, None], _columns(words.shape[1])[None, :], out=t)
    _a_terms(words, t, x, t)
    a = x.sum(axis=1, dtype=np.uint64).tolist()
    _b_terms(x, t)
    return a, x.sum(axis=1, dtype=np.uint64).tolist()


def device_row_lanes(words, bases):
    """(A, B) of each row as an int64 tensor (2, rows) on the words' device, from int64 ``words`` (rows ×
    row_words) and int64 ``bases``: ``host_row_lanes`` in torch ops, bit for bit."""
    import torch

    index = bases[:, None] + torch.arange(words.shape[1], dtype=torch.int64, device=words.device)[None, :]
    x = torch.mul(words, _M1).bitwise_xor_(index)
    t = index  # spent: scratch from here
    _device_fmix_(x, t)
    a = x.sum(dim=1)
    y = x.mul_(_M3)
    torch.bitwise_right_shift(y, 32, out=t).bitwise_and_(_LOW32)
    return torch.stack([a, y.bitwise_xor_(t).sum(dim=1)])


def _group_lanes(a: list[int], b: list[int], groups, rows: int, copies: int = 1) -> list[tuple[int, tuple[int, int]]]:
    """Each copy's each group's (rows, (A, B)) from per-row lanes, copies of ``rows`` rows end to end."""
    out = []
    for k in range(copies):
        first = k * rows
        for runs in groups:
            span = [r for x, y in runs for r in range(first + x, first + y)]
            out.append((len(span), (sum(a[r] for r in span) & _MASK64, sum(b[r] for r in span) & _MASK64)))
    return out


def start_rows(value, groups: list[list[tuple[int, int]]]) -> list:
    """Each group's digest of its rows of ``value``: ``groups[g]`` lists runs ``(start, stop)`` of the leading
    dimension, and its digest is ``start()``'s of those rows concatenated in order. On the host, when a row is whole
    64-bit words, every group is hashed in one pass over the batch (see above); else, and on a device, group by
    group. Runs must lie within the leading dimension and not overlap."""
    array = as_tensor_or_array(value)
    if not array.ndim:
        raise ValueError("a 0-dimensional array has no rows to split: digest it whole")
    on_host = isinstance(array, np.ndarray) or (array.device.type == "cpu" and storage_problem(array) is None)
    if on_host and array.shape[0]:
        name, shape, data = _host_bytes(array)
        row_bytes = len(data) // shape[0]
        if row_bytes and row_bytes % 8 == 0 and len(data) // 8 <= ROWS_PASS_WORDS:
            kept = _Kept(name, tuple(shape), groups)
            digests = kept.add(data)  # hashed now, before the caller can change the bytes: no copy
            kept.start()
            return digests
    return [start(_take(array, runs)) for runs in groups]


class RowBatches:
    """Tensors whose groups of rows are hashed later, many tensors together: ``add`` keeps a copy of the tensor
    (on the host its bytes; on a GPU a device copy, made on the producer's stream) and returns each group's digest,
    which is computed, for every copy of the same dtype, shape, groups and device kept so far, in one pass over the
    copies end to end when one of them is asked for (on a GPU: launched on a side stream, read when its event says
    so) or when the copies reach ``ROWS_PASS_WORDS``. A decode loop hands the same layout at every step: its hooks
    then cost a copy each, not a hash, and the hash's fixed cost (a GPU's ~20 kernel launches) is paid once for many
    steps. What cannot wait this way (rows that are not whole words) is started now (``start_rows``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple, _Kept] = {}

    def add(self, value, groups: list[list[tuple[int, int]]]) -> list:
        array = as_tensor_or_array(value)
        if not (array.ndim and array.shape[0]):
            return start_rows(array, groups)
        on_host = isinstance(array, np.ndarray) or array.device.type == "cpu"
        if on_host:
            problem = None if isinstance(array, np.ndarray) else storage_problem(array)
            if problem is not None:
                return [Failed(f"cannot digest the tensor: {problem}")] * len(groups)
            name, shape, data = _host_bytes(array)
            nbytes, device, stream = len(data), None, None
        elif array.device.type == "cuda":
            import torch

            name, shape, nbytes = torch_dtype_name(array.dtype), tuple(array.shape), array.numel() * array.element_size()
            device, stream = array.device, torch.cuda.current_stream(array.device)
        else:
            return start_rows(array, groups)
        row_bytes = nbytes // shape[0]
        if not row_bytes or row_bytes % 8 or nbytes // 8 > ROWS_PASS_WORDS:
            return start_rows(array, groups)
        row_bases(shape[0], row_bytes // 8, groups)  # runs outside the rows: a one-line error now, not later
        key = (name, tuple(shape), tuple(tuple(runs) for runs in groups), device, stream)
        with self._lock:
            kept = self._open.get(key)
            if kept is None:
                kept = self._open[key] = _Kept(name, tuple(shape), groups, stream)
            # the bytes as of now (an all-reduce overwrites its input next): a host copy, or a device copy ordered
            # on the producer's stream
            later = kept.add(data.copy() if on_host else _flat(array).clone())
            if kept.words >= ROWS_PASS_WORDS:
                del self._open[key]
                kept.start()
        return later


class _Kept:
    """The copies of one layout's tensors, and once hashed, every group's digest of every copy in order."""

    def __init__(self, name: str, shape: tuple, groups: list[list[tuple[int, int]]], stream=None):
        self.name, self.shape, self.groups, self.stream = name, shape, groups, stream
        self.copies: list = []
        self.words = 0
        self.digests: list[tuple[str, bytes]] | None = None
        self.error: str | None = None
        self._device = None  # on a GPU, once started: (pinned lanes, event, what must live until it fires)
        self._lock = threading.Lock()

    def add(self, copy) -> list[Later]:
        first = len(self.copies) * len(self.groups)
        self.copies.append(copy)
        self.words += (copy.nbytes if isinstance(copy, np.ndarray) else copy.numel() * copy.element_size()) // 8
        return [Later(self, first + g) for g in range(len(self.groups))]

    def start(self) -> None:
        """Hash the copies: now on the host; on a GPU, launched on a side stream."""
        with self._lock:
            if self.digests is not None or self.error is not None or self._device is not None:
                return
            rows, copies = self.shape[0], len(self.copies)
            bases = np.tile(row_bases(rows, self.words // (rows * copies), self.groups), copies)
            try:
                if self.stream is None:
                    words = np.concatenate(self.copies).view("<u8").reshape(rows * copies, -1)
                    self._finish(*host_row_lanes(words, bases))
                else:
                    self._launch(bases)
            except Exception as exc:  # a device error: every digest of the batch says so
                self.error = f"the device failed while digesting the tensor ({_one_line(exc)})"
            self.copies = []

    def _launch(self, bases: np.ndarray) -> None:
        import torch

        rows = len(bases)
        side = _side_stream(self.stream.device)
        side.wait_stream(self.stream)  # the copies were made in the producer's order; the host does not wait
        with torch.cuda.stream(side):
            words = torch_words(torch.cat(self.copies)).view(rows, -1)
            pinned = torch.from_numpy(bases.view(np.int64)).pin_memory()  # an asynchronous copy needs pinned memory
            on_device = pinned.to(self.stream.device, non_blocking=True)
            lanes = device_row_lanes(words, on_device)
            host = torch.empty((2, rows), dtype=torch.int64, pin_memory=True)
            host.copy_(lanes, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        for copy in self.copies:
            copy.record_stream(side)  # the allocator may not reuse them before the side stream is done
        self._device = (host, ready, (pinned, words, on_device, lanes))

    def _finish(self, a: list[int], b: list[int]) -> None:
        lanes = _group_lanes(a, b, self.groups, self.shape[0], len(a) // self.shape[0])
        payloads = [payload(self.name, (n, *self.shape[1:]), sums) for n, sums in lanes]
        self.digests = [(framed(TAG, p), p) for p in payloads]

    def done(self) -> bool:
        self.start()
        with self._lock:
            if self.digests is not None or self.error is not None:
                return True
            host, ready, _ = self._device
            try:
                if not ready.query():
                    return False
                a, b = host.tolist()  # pinned host memory: no device access
                self._finish([v & _MASK64 for v in a], [v & _MASK64 for v in b])
            except Exception as exc:  # a CUDA error raised by the query: the spans say so
                self.error = f"the device failed before the digest was ready ({_one_line(exc)})"
            self._device = None
            return True


class Later:
    """A digest ``RowBatches`` computes when it is first asked for, with every other digest of its layout;
    ``done()`` polls without blocking, ``result()`` waits (on a GPU, for its event)."""

    def __init__(self, kept: _Kept, index: int):
        self._kept, self._index = kept, index

    def done(self) -> bool:
        return self._kept.done()

    def result(self, timeout_s: float | None = None) -> str:
        return self._wait(timeout_s)[0]

    def payload(self, timeout_s: float | None = None) -> bytes:
        return self._wait(timeout_s)[1]

    def _wait(self, timeout_s: float | None) -> tuple[str, bytes]:
        _wait_until(self._kept.done, timeout_s)
        if self._kept.error is not None:
            raise DigestUnavailable(self._kept.error)
        return self._kept.digests[self._index]


def _take(array, runs: list[tuple[int, int]]):
    if len(runs) == 1:
        return array[runs[0][0] : runs[0][1]]
    if isinstance(array, np.ndarray):
        return np.concatenate([array[a:b] for a, b in runs])
    import torch

    return torch.cat([array[a:b] for a, b in runs])


def _flat(tensor):
    """The tensor's values as a contiguous 1-d tensor of its dtype (a view when it already is one)."""
    try:
        return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
    except RuntimeError as exc:
        raise TypeError(f"cannot digest a {torch_dtype_name(tensor.dtype)} tensor: {_one_line(exc)}") from None


def _lane_ints(values) -> tuple[int, int]:
    return values[0] & _MASK64, values[1] & _MASK64


# -- CUDA: hashed on a side stream, read back when its event says so
_side_streams: dict = {}
_side_lock = threading.Lock()


def _side_stream(device):
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
    private = torch.mul(torch_words(_flat(tensor)), _M1)
    side = _side_stream(tensor.device)
    side.wait_stream(producer)  # an event between the streams: the host does not wait
    with torch.cuda.stream(side):
        lanes = device_lanes(private, premultiplied=True)
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(lanes, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    private.record_stream(side)  # the allocator may not hand it to the producer's stream before the side is done
    return Pending(torch_dtype_name(tensor.dtype), tensor.shape, host, ready, (private, lanes))
