"""The files a spool is made of, and the ordered queue of them that its batches and write-ahead records share.

Batches (``exporters.spool``) and write-ahead records (``exporters.wal``) wait in one queue, oldest first, so that
what arrived first is stored first whichever kind it is. A segment is written to a temporary file, fsynced, then
renamed into place and its directory fsynced, so it is whole or absent even after kill -9 or a power cut.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stagetrace.environment_variables import STAGETRACE_SPOOL_MAX_BYTES
from stagetrace.exporters.dropped import DROPPED, dropped_kind

logger = logging.getLogger("stagetrace.exporters.spool")  # one logger for the spool's lines, whichever part says them

# batches: <seq>.<table>.<rows>.seg; write-ahead records: <seq>.<kind>.<rows>.<token>[.<group>].wal
SEGMENT_NAME = re.compile(
    r"^(\d{20})\.([A-Za-z_][A-Za-z0-9_]*)\.(\d+)(?:\.seg|\.([0-9a-f]{32})(?:\.([0-9a-f]{32}))?\.wal)$"
)


def new_token() -> str:
    """A deduplication token for one batch."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Segment:
    path: Path
    table: str  # a batch's table, or a write-ahead record's kind
    rows: int
    size: int
    token: str = ""  # a write-ahead record's request token ("" for a batch)
    group: str = ""  # the token of the group a record was sealed into ("" before)

    @property
    def record(self) -> bool:
        return bool(self.token)

    @classmethod
    def named(cls, path: Path, size: int) -> Segment | None:
        match = SEGMENT_NAME.match(path.name)
        if match is None:
            return None
        return cls(path, match[2], int(match[3]), size, match[4] or "", match[5] or "")


class SegmentQueue:
    """The segments in ``directory``, oldest first, bounded by ``max_bytes``, and what dropping one counts."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes
        self.dropped_rows = 0  # by this spool; DROPPED has the process-wide count
        self.on_drop: Callable[[Segment], None] | None = None  # told of each segment dropped
        self._lock = threading.Lock()
        self._seq = 0
        self._segments: list[Segment] = []

    # state

    def rows(self, table: str | None = None) -> int:
        with self._lock:
            return sum(s.rows for s in self._segments if table is None or s.table == table)

    def bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._segments)

    def __len__(self) -> int:
        with self._lock:
            return len(self._segments)

    def oldest(self, table: str | None = None) -> Segment | None:
        with self._lock:
            return next((s for s in self._segments if table is None or s.table == table), None)

    def remove(self, segment: Segment) -> None:
        with self._lock:
            self._discard(segment)

    def unreadable(self, segment: Segment, why) -> None:
        """Drop a segment that cannot be read or decoded, counted."""
        with self._lock:
            self._discard(segment)
            self._count_dropped(
                segment.table, segment.rows, "unreadable_segment", f"segment {segment.path.name} is unreadable ({why})"
            )
        self._notify_dropped([segment])

    # internals (called with self._lock held)

    def _next_seq(self) -> int:
        """The next segment's sequence number: its time, or one past the last, so that names sort in arrival order."""
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    def _notify_dropped(self, segments: list[Segment]) -> None:
        # outside self._lock: the callback takes its writer's lock, which may be held while asking len(self)
        for segment in segments:
            if self.on_drop is not None:
                self.on_drop(segment)

    def _discard(self, segment: Segment) -> None:
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass
        if segment in self._segments:
            self._segments.remove(segment)

    def _count_dropped(self, table: str, rows: int, reason: str, why: str, quiet: bool = False) -> None:
        kind = dropped_kind(table)
        self.dropped_rows += rows
        DROPPED.add(kind, rows, reason)
        if quiet:
            return
        advice = f" (raise {STAGETRACE_SPOOL_MAX_BYTES})" if reason == "spool_full" else ""
        logger.error("spool %s: dropped %d %s: %s%s", self.directory, rows, kind.replace("_", " "), why, advice)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all, fsynced, the rename too."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.rename(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # the rename itself must survive a power cut
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["SEGMENT_NAME", "Segment", "SegmentQueue", "new_token", "write_atomically"]
