"""The array hash: two 64-bit sums ("lanes") of per-word terms, on the host with NumPy or on any device with
torch ops, bit for bit the same.

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
"""

from __future__ import annotations

import functools

import numpy as np

M1, C1, C2, M3 = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0xBF58476D1CE4E5B9
HOST_CHUNK_WORDS = 1 << 15  # 256 KiB of words and two temporaries of that size stay in a core's L2 cache
DEVICE_CHUNK_WORDS = 1 << 23  # 64 MiB temporaries on the device: a larger tensor is hashed in several chunks
MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 scalar (torch has no unsigned 64-bit arithmetic: int64 wraps the same)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _C1, _C2, _M3 = _signed(M1), _signed(C1), _signed(C2), _signed(M3)
# torch's >> on int64 is arithmetic: masking the shifted value makes it the logical shift the definition uses
_LOW31, _LOW32 = (1 << 31) - 1, (1 << 32) - 1
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
    return a & MASK64, b & MASK64


def host_words(data: np.ndarray) -> np.ndarray:
    """The little-endian uint64 words of a C-contiguous uint8 array, zero-padded (a copy only when padding)."""
    if len(data) % 8:
        padded = np.zeros((len(data) + 7) // 8 * 8, np.uint8)
        padded[: len(data)] = data
        data = padded
    return data.view("<u8")


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


def lane_ints(values) -> tuple[int, int]:
    return values[0] & MASK64, values[1] & MASK64


def premultiplied(words):
    """``words * M1``, the hash's first step, as a new int64 tensor: what ``device_lanes(..., premultiplied=True)``
    takes (the CUDA path runs it on the producer's stream)."""
    import torch

    return torch.mul(words, _M1)
