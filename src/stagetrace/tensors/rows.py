"""The rows of a batch, each group's own: ``start(batch[rows])`` for every group, in one pass.

A group's rows, concatenated, are its content: the word at column c of the j-th of its rows has index
j * row_words + c in it. So each row of the batch is hashed once with its own first index ("base"), its terms
summed per row, and a group's lanes are the sums of its rows' (the terms depend on one word and its index only).
Rows of many tensors of one layout (a decode loop's steps) are hashed the same way, end to end. Only the PyTorch
integration (``stagetrace.integrations.pytorch``) batches rows.
"""

from __future__ import annotations

import threading

import numpy as np

from stagetrace.frames import framed
from stagetrace.tensors.arrays import as_tensor_or_array, described, flat, host_bytes, storage_problem, torch_dtype_name
from stagetrace.tensors.digests import TAG, DigestUnavailable, Failed, payload, side_stream, start, wait_until
from stagetrace.tensors.lanes import MASK64, device_row_lanes, host_row_lanes, torch_words

ROWS_PASS_WORDS = 1 << 21  # a batch up to 16 MiB is split among its groups in one pass (two temporaries its size)


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


def _group_lanes(a: list[int], b: list[int], groups, rows: int, copies: int = 1) -> list[tuple[int, tuple[int, int]]]:
    """Each copy's each group's (rows, (A, B)) from per-row lanes, copies of ``rows`` rows end to end."""
    out = []
    for k in range(copies):
        first = k * rows
        for runs in groups:
            span = [r for x, y in runs for r in range(first + x, first + y)]
            out.append((len(span), (sum(a[r] for r in span) & MASK64, sum(b[r] for r in span) & MASK64)))
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
        name, shape, data = host_bytes(array)
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
            name, shape, data = host_bytes(array)
            nbytes, device, stream = len(data), None, None
        elif array.device.type == "cuda":
            import torch

            name, shape, nbytes = (
                torch_dtype_name(array.dtype),
                tuple(array.shape),
                array.numel() * array.element_size(),
            )
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
            later = kept.add(data.copy() if on_host else flat(array).clone())
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
                self.error = f"the device failed while digesting the tensor ({described(exc)})"
            self.copies = []

    def _launch(self, bases: np.ndarray) -> None:
        import torch

        rows = len(bases)
        side = side_stream(self.stream.device)
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
                self._finish([v & MASK64 for v in a], [v & MASK64 for v in b])
            except Exception as exc:  # a CUDA error raised by the query: the spans say so
                self.error = f"the device failed before the digest was ready ({described(exc)})"
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
        wait_until(self._kept.done, timeout_s)
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
