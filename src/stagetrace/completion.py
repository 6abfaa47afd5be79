"""Spans whose values are still being computed on a device: ended later, off the caller's thread, with their own end.

A stage whose content is a GPU tensor ends when the caller leaves it, but its digest is ready only when the device
has hashed the tensor. ``submit`` takes the span, the attributes still pending (``done()`` / ``result()`` objects
from ``stagetrace.tensors``) and the time the stage really ended; when every value is ready, a small daemon thread
sets them and ends the span at that time. Nothing here waits on a stream: the thread polls CUDA events.

Whatever goes wrong leaves a span that says so, never a hang: a value that failed (a CUDA error, a tensor whose
storage was freed) is replaced by ``stagetrace.digest.error``; ``stagetrace.flush`` and ``shutdown`` wait for
pending spans up to their timeout; at process exit pending spans get a few seconds, then end with the error
"the process exited before ...".
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

# Why a span lacks a value it should have. Not yet a name in ``conventions``: under the ``stagetrace.`` prefix,
# which the analysis never compares, so it is never blamed as a cause.
DIGEST_ERROR = "stagetrace.digest.error"
EXIT_WAIT_S = 5.0
_POLL_MIN_S, _POLL_MAX_S = 50e-6, 2e-3


class _Item:
    __slots__ = ("span", "pending", "end_ns")

    def __init__(self, span, pending: dict, end_ns: int):
        self.span, self.pending, self.end_ns = span, pending, end_ns

    def done(self) -> bool:
        return all(value.done() for value in self.pending.values())


def finish(span, pending: dict, end_ns: int, why_missing: str | None = None) -> None:
    """Set the span's pending attributes (each one that failed as ``DIGEST_ERROR``) and end it at ``end_ns``."""
    errors = []
    for key, value in pending.items():
        if why_missing is not None and not value.done():
            errors.append(f"{key}: {why_missing}")
            continue
        try:
            result = value.result()
        except Exception as exc:  # DigestUnavailable, or a device error raised while reading
            errors.append(f"{key}: {exc}")
            continue
        span.set_attribute(key, result)
    if errors:
        span.set_attribute(DIGEST_ERROR, "; ".join(errors))
    span.end(end_time=end_ns)


class Completer:
    """One daemon thread that ends spans once their pending values are ready."""

    def __init__(self):
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._finishing = 0  # taken off the queue, being ended now
        self._atexit = False

    def submit(self, span, pending: dict, end_ns: int) -> None:
        item = _Item(span, pending, end_ns)
        if _settled(item):  # host content, or a device that was quick: end it here, in order
            finish(span, pending, end_ns)
            return
        with self._cond:
            self._queue.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stagetrace-completer", daemon=True)
                self._thread.start()
            if not self._atexit:  # registered after the tracer provider's own: runs before it shuts down
                atexit.register(self.close)
                self._atexit = True
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._finishing

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted span has ended; False if some are still pending after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._finishing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """At exit: give pending spans ``wait_s``, then end the rest saying their values never came."""
        if not self.drain(wait_s):
            with self._cond:
                left, self._queue = list(self._queue), deque()
                self._cond.notify_all()
            for item in left:
                finish(item.span, item.pending, item.end_ns, "the process exited before the value was ready")
            logger.warning("%d spans ended without their device digests: the process exited first", len(left))

    def _run(self) -> None:
        pause = _POLL_MIN_S
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                items = list(self._queue)
            ready = [item for item in items if _settled(item)]
            if not ready:
                time.sleep(pause)  # events are polled, never waited on: a hung device cannot hang anyone
                pause = min(pause * 2, _POLL_MAX_S)
                continue
            with self._cond:
                ready = [item for item in ready if item in self._queue]  # close() may have taken some
                for item in ready:
                    self._queue.remove(item)
                self._finishing += len(ready)
            try:
                for item in ready:
                    finish(item.span, item.pending, item.end_ns)
            finally:
                with self._cond:
                    self._finishing -= len(ready)
                    self._cond.notify_all()
            pause = _POLL_MIN_S


def _settled(item: _Item) -> bool:
    try:
        return item.done()
    except Exception:  # a value whose done() raised: finish() records why
        return True


_completer = Completer()


def submit(span, pending: dict, end_ns: int) -> None:
    _completer.submit(span, pending, end_ns)


def drain(timeout_s: float) -> bool:
    return _completer.drain(timeout_s)
