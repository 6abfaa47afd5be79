"""The stages that live inside PyTorch: the tensor-parallel all-reduce and decode, recorded from the model itself.

    import stagetrace
    from stagetrace.integrations import pytorch as stagetrace_torch

    stagetrace_torch.record_collectives()            # torch.distributed.all_reduce -> the request's allreduce stage
    stagetrace_torch.record_decode(model.lm_head)    # the module's output (logits) -> the request's decode stage

    with stagetrace.request(rid, input=prompt) as req, stagetrace_torch.serving(req):
        ...  # the request's forward passes

Only what runs inside a ``serving`` block is recorded, for the requests it names; elsewhere the hooks cost one
context-variable read. Each request gets **one span per stage and rank** for the whole block (never a span per
collective or per decode step), as the span conventions ask (docs/design.md#span-conventions):

- ``allreduce``: ``allreduce.count``, ``allreduce.bytes`` (the collectives' whole tensors), ``allreduce.time_ms`` and
  ``allreduce.max_ms`` (CUDA events on a GPU, the host's clock on the CPU), ``parallel.tp_rank`` and
  ``parallel.tp_size`` of the collective's group; input digest: the rank's contributions (what it handed to each
  all_reduce), output digest: the reduced results, each folded over the collectives in order
  (``digest([d1, d2, ...])``), and ``stagetrace.stage.step_input_digests``: the first 256 contributions' digests,
  so that ``explain`` names the rank whose contribution differed first, not every rank that summed it afterwards.
- ``decode``: the hooked module's input and output (logits or token IDs), folded over its calls in order;
  ``decode.batch_size``: the rows its output had (the batch the request shared).

Other ranks (processes) name the request by the carrier rank 0 sent them: ``serving(carrier)`` with
``carrier = req.carrier()``. A batch that holds several requests says which rows are whose:
``serving([(req_a, slice(0, 2)), (req_b, [2])])``; every recorded tensor whose leading dimension is the batch's
rows is then split, and each request digests its own rows (a tensor of another leading size is each one's whole).

Each recorded tensor is copied at the hook (on a GPU, on the producer's stream) and hashed later, many steps of one
shape in one pass (``tensors.RowBatches``); on a GPU on the device, the spans completed off the caller's thread
(``stagetrace.completion``): recording never synchronises the stream. Recording never breaks the model either: a
tensor that cannot be digested leaves ``stagetrace.digest.error`` on the span instead of a digest. Eager mode only:
``torch.compile`` and CUDA graphs do not call these hooks per step. Hooks see the thread that entered ``serving``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from stagetrace import tensors, tracing
from stagetrace.digest import Folded, Steps
from stagetrace.conventions import STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST, STAGE_STEP_INPUT_DIGESTS, TP_SIZE

logger = logging.getLogger(__name__)

# the recommended stage attributes (docs/design.md#span-conventions) (conventions lists them among the measurements)
ALLREDUCE_COUNT, ALLREDUCE_BYTES = "allreduce.count", "allreduce.bytes"
ALLREDUCE_TIME_MS, ALLREDUCE_MAX_MS = "allreduce.time_ms", "allreduce.max_ms"
DECODE_BATCH_SIZE = "decode.batch_size"

_active: contextvars.ContextVar[serving | None] = contextvars.ContextVar("stagetrace_torch_serving", default=None)


# -- which rows are whose
def _runs(rows) -> list[tuple[int, int]]:
    """A request's rows as runs [start, stop) of the batch's leading dimension, in the order given."""
    if isinstance(rows, bool):
        raise ValueError(f"rows must be an int, a slice, a range or a list of ints, not {rows!r}")
    if isinstance(rows, int):
        rows = [rows]
    elif isinstance(rows, (slice, range)):
        if rows.step not in (None, 1) or rows.stop is None:
            raise ValueError(f"rows {rows!r}: give a slice with a stop and step 1 (or a list of row numbers)")
        rows = range(rows.start or 0, rows.stop)
    try:
        indices = [int(i) for i in rows]
    except (TypeError, ValueError):
        raise ValueError(f"rows must be an int, a slice, a range or a list of ints, not {rows!r}") from None
    if not indices or min(indices) < 0:
        raise ValueError(f"rows {rows!r}: a request needs at least one row, numbered from 0")
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _is_parent(value) -> bool:
    """A request or stage, an OpenTelemetry Context or a ``traceparent`` carrier (both mappings with text keys)."""
    return isinstance(value, tracing._Span) or (isinstance(value, Mapping) and all(isinstance(k, str) for k in value))


class _Member:
    """One request of the batch: its parent span, its rows, and the digests recorded for it, in order."""

    def __init__(self, parent, runs: list[tuple[int, int]] | None):
        self.parent, self.runs = parent, runs
        self.allreduce_in: list = []
        self.allreduce_out: list = []
        self.decode_in: list = []
        self.decode_out: list = []


class _Window:
    """When a stage ran in this block, how often, on how many bytes, and how long each call took."""

    def __init__(self):
        self.count = self.bytes = 0
        self.start_ns = self.end_ns = 0
        self.times: list = []  # per call: (start event, end event) on a GPU, else seconds

    def begin(self) -> int:
        now = time.time_ns()
        if not self.count:
            self.start_ns = now
        return now

    def end(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        self.end_ns = time.time_ns()


_SERVING_TAKES = "serving() takes a request (or a carrier), or (request, rows) pairs for a batch"


class serving:
    """``with serving(requests):`` — the forward passes inside serve these requests (see the module docstring).

    ``requests``: a request (``stagetrace.request``), stage, OpenTelemetry Context or ``traceparent`` carrier; or,
    for a batch, (request, rows) pairs or a mapping request -> rows, rows being an int, a slice, a range or a list
    of row numbers of the batch's leading dimension. ``rank``: this process's tensor-parallel rank, when it is not
    its rank in the collectives' group.
    """

    def __init__(self, requests, *, rank: int | None = None):
        if _is_parent(requests):
            members = [_Member(requests, None)]
        else:
            try:
                pairs = list(requests.items() if isinstance(requests, Mapping) else requests)
                if not all(len(pair) == 2 and _is_parent(pair[0]) for pair in pairs):
                    raise TypeError
            except TypeError:
                raise TypeError(_SERVING_TAKES) from None
            if not pairs:
                raise ValueError("serving() needs at least one request")
            members = [_Member(parent, _runs(rows)) for parent, rows in pairs]
        self._members = members
        self._rows = max((stop for m in members if m.runs for _, stop in m.runs), default=None)
        self._rank = rank
        self._group_rank: int | None = None  # in the collectives' group, from the first one
        self._tp_size: int | None = None
        self._allreduce, self._decode = _Window(), _Window()
        self._decode_rows: int | None = None
        self._batches = tensors.RowBatches()  # host tensors hashed many steps at a time, at the latest on exit
        self._token = None

    def __enter__(self) -> serving:
        self._token = _active.set(self)
        return self

    def __exit__(self, *exc) -> bool:
        _active.reset(self._token)
        try:
            self._emit()
        except Exception:  # recording must never take the request down
            logger.exception("stagetrace: could not record the PyTorch stages of a request")
        return False

    # -- what each request gets of a tensor
    def _digests(self, tensor) -> list:
        """Each member's digest of its rows of ``tensor`` (computed later on the host, pending on a device, or
        Failed): a tensor whose leading dimension is the batch's rows is split, one pass for all members; any
        other is each one's whole."""
        members = self._members
        try:
            if tensor.dim() and members[0].runs is not None and tensor.shape[0] == self._rows:
                return self._batches.add(tensor, [member.runs for member in members])
            if tensor.dim():
                return self._batches.add(tensor, [[(0, tensor.shape[0])]]) * len(members)
            return [tensors.start(tensor)] * len(members)
        except Exception as exc:  # a tensor that cannot be digested: the span says so, the model goes on
            return [tensors.Failed(f"cannot digest the tensor: {exc}")] * len(members)

    # -- the collectives
    def _collective_begins(self, tensor, group):
        if self._group_rank is None and dist.is_initialized():
            self._group_rank, self._tp_size = dist.get_rank(group), dist.get_world_size(group)
        self._allreduce.begin()
        for member, started in zip(self._members, self._digests(tensor)):
            member.allreduce_in.append(started)
        return _clock_start(tensor)

    def _collective_ends(self, clock, tensor, async_op: bool) -> None:
        self._allreduce.times.append(_clock_stop(clock, tensor))
        if async_op:
            # its result exists only after work.wait(), which happens out of sight
            reason = tensors.Failed("all_reduce(async_op=True): its output is ready only after wait(), not digested")
            outputs = [reason] * len(self._members)
        else:
            outputs = self._digests(tensor)
        for member, started in zip(self._members, outputs):
            member.allreduce_out.append(started)
        self._allreduce.end(tensor.numel() * tensor.element_size())

    # -- the decode module's calls
    def _decoded(self, inputs, output) -> None:
        self._decode.begin()
        if self._decode_rows is None and output.dim():
            self._decode_rows = int(output.shape[0])
        first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if first is not None:
            for member, started in zip(self._members, self._digests(first)):
                member.decode_in.append(started)
        for member, started in zip(self._members, self._digests(output)):
            member.decode_out.append(started)
        self._decode.end(output.numel() * output.element_size())

    def _emit(self) -> None:
        rank, tp_size = self._rank, self._tp_size
        if rank is None:
            rank = self._group_rank
        if rank is None and dist.is_initialized() and dist.get_world_size() > 1:  # decode alone, several ranks
            rank = dist.get_rank()
        times = _Times(self._allreduce.times)
        for member in self._members:
            if self._allreduce.count:
                tracing.measured_stage(
                    "allreduce",
                    parent=member.parent,
                    rank=rank,
                    start_time_ns=self._allreduce.start_ns,
                    end_time_ns=self._allreduce.end_ns,
                    attributes={
                        TP_SIZE: tp_size,
                        ALLREDUCE_COUNT: self._allreduce.count,
                        ALLREDUCE_BYTES: self._allreduce.bytes,
                    },
                    values={
                        STAGE_INPUT_DIGEST: Folded(member.allreduce_in),
                        STAGE_STEP_INPUT_DIGESTS: Steps(member.allreduce_in),
                        STAGE_OUTPUT_DIGEST: Folded(member.allreduce_out),
                        ALLREDUCE_TIME_MS: times.total_ms(),
                        ALLREDUCE_MAX_MS: times.max_ms(),
                    },
                )
            if self._decode.count:
                values = {STAGE_OUTPUT_DIGEST: Folded(member.decode_out)}
                if member.decode_in:
                    values[STAGE_INPUT_DIGEST] = Folded(member.decode_in)
                tracing.measured_stage(
                    "decode",
                    parent=member.parent,
                    rank=rank,
                    start_time_ns=self._decode.start_ns,
                    end_time_ns=self._decode.end_ns,
                    attributes={DECODE_BATCH_SIZE: self._decode_rows},
                    values=values,
                )


# -- timing: CUDA events on a GPU (read when they are done), the host's clock on the CPU
def _clock_start(tensor):
    if tensor.is_cuda:  # on the stream the collective is ordered on: the tensor's device's current stream
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(tensor.device))
        return event
    return time.perf_counter()


def _clock_stop(start, tensor):
    if tensor.is_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(tensor.device))
        return start, event
    return time.perf_counter() - start


class _Times:
    """The collectives' durations: known now on the CPU, when their events are done on a GPU."""

    def __init__(self, times: list):
        self.times = times

    def done(self) -> bool:
        return all(not isinstance(t, tuple) or t[1].query() for t in self.times)

    def milliseconds(self) -> list[float]:
        return [t[0].elapsed_time(t[1]) if isinstance(t, tuple) else t * 1e3 for t in self.times]

    def total_ms(self):
        return _Deferred(self, lambda ms: round(sum(ms), 3))

    def max_ms(self):
        return _Deferred(self, lambda ms: round(max(ms), 3))


class _Deferred:
    def __init__(self, times: _Times, reduce):
        self._times, self._reduce = times, reduce

    def done(self) -> bool:
        return self._times.done()

    def result(self):
        return self._reduce(self._times.milliseconds())


# -- turning it on
class _Recording:
    """``record_collectives()``'s handle: ``remove()`` puts ``torch.distributed``'s own functions back."""

    def __init__(self, originals: dict):
        self._originals = originals

    def remove(self) -> None:
        global _recording
        with _patch_lock:
            for (module, name), function in self._originals.items():
                setattr(module, name, function)
            _recording = None


_recording: _Recording | None = None
_patch_lock = threading.Lock()


def record_collectives() -> _Recording:
    """Record ``torch.distributed.all_reduce`` calls made inside ``serving`` as the requests' ``allreduce`` stage.
    Call it before the model code takes its own reference (``from torch.distributed import all_reduce``)."""
    global _recording
    with _patch_lock:
        if _recording is not None:
            return _recording
        import torch.distributed.distributed_c10d as c10d

        original = c10d.all_reduce
        recording = _recording_all_reduce(original)
        originals = {}
        for module in (dist, c10d):
            originals[(module, "all_reduce")] = getattr(module, "all_reduce")
            setattr(module, "all_reduce", recording)
        _recording = _Recording(originals)
        return _recording


def _recording_all_reduce(original):
    @functools.wraps(original)
    def all_reduce(tensor, *args, **kwargs):
        batch = _active.get()
        if batch is None or not isinstance(tensor, torch.Tensor):
            return original(tensor, *args, **kwargs)
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        clock = batch._collective_begins(tensor, group)
        work = original(tensor, *args, **kwargs)
        batch._collective_ends(clock, tensor, async_op)
        return work

    return all_reduce


def record_decode(module: torch.nn.Module, *, select=None, inputs: bool = True):
    """Record ``module``'s calls inside ``serving`` as the requests' ``decode`` stage: its output (logits, or the
    token IDs of a sampling module) and, unless ``inputs=False``, its first input. ``select(output)`` picks the
    tensor when the output is not one (default: the output itself, a tuple's first tensor, or a model output's
    ``logits``). Returns the hook's handle (``.remove()``). A sampler hooked with ``inputs=False`` records token IDs
    only: the cheapest decode content (its input, the logits, is the largest tensor of a step)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"record_decode needs a torch.nn.Module, not {type(module).__name__}")

    def hook(_module, args, output):
        batch = _active.get()
        if batch is None:
            return
        tensor = select(output) if select is not None else _decode_tensor(output)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"record_decode: the output is a {type(tensor).__name__}; pass select= to pick its tensor")
        batch._decoded(args if inputs else (), tensor)

    return module.register_forward_hook(hook)


def _decode_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "logits", output)
