"""Durable spool: batches the store did not take, on disk, replayed in order once it takes inserts again.

A writer gives every batch a deduplication token before its first insert attempt and keeps it with the
batch in the spool, so a replay of a batch the store took after all (an insert that timed out after the
server committed it) adds nothing: ClickHouse drops a block whose ``insert_deduplication_token`` it has
seen among the last ``non_replicated_deduplication_window`` blocks of the table (the schema sets it).

Layout: ``<directory>/<kind>/<slot>/<seq>.<table>.<rows>.seg``, one zlib-compressed JSON batch per segment,
written to a temporary file, fsynced, then renamed into place, so a segment is whole or absent even after
kill -9 or a power cut. A process holds its slot by an flock on ``<slot>/lock``; the next free slot goes
to the next process writing the same store, and a process adopts the segments of slots nobody holds (a
predecessor that died), so what a dead process spooled is replayed by whoever writes next. A process that
cannot write the store because the agent holds it writes into ``<kind>/inbox`` instead, which the agent's
writers adopt every few seconds.

The spool is bounded by ``max_bytes``; when a new segment would exceed it, the oldest segments are dropped,
counted in ``stagetrace_dropped_spans_total`` / ``stagetrace_dropped_metric_samples_total`` (by ``reason``)
and logged.

Settings are arguments with environment fallbacks: ``STAGETRACE_SPOOL_DIR`` (``off`` disables the spool),
``STAGETRACE_SPOOL_MAX_BYTES`` (256 MiB). The default directory is beside an embedded store on disk
(``<store>.spool``), else ``$XDG_STATE_HOME/stagetrace/spool/<host>-<port>-<database>``; an in-memory
store, which does not outlive the process, has no spool.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from stagetrace.store import StoreError

logger = logging.getLogger(__name__)

ENV_SPOOL_DIR = "STAGETRACE_SPOOL_DIR"
ENV_SPOOL_MAX_BYTES = "STAGETRACE_SPOOL_MAX_BYTES"
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_SLOTS = 64
INBOX = "inbox"  # where a process that cannot write the store (held by the agent) hands its batches over
_SEGMENT = re.compile(r"^(\d{20})\.([A-Za-z_][A-Za-z0-9_]*)\.(\d+)\.seg$")
_FORMAT = 1


class SpoolError(StoreError):
    """The spool directory cannot be used; the message says which and what to do (a StoreError: the
    commands report it as they report a store they cannot use)."""


def new_token() -> str:
    """A deduplication token for one batch."""
    return uuid.uuid4().hex


# --- what was dropped, for /metrics -------------------------------------------------------------------------


# why rows were dropped: the ``reason`` label's values
REASONS = (
    "spool_full",  # the spool reached its size limit and dropped its oldest segments
    "spool_write_failed",  # the disk refused a segment (full, read-only, failing)
    "unreadable_segment",  # a segment that no longer decodes
    "rejected_row",  # a row the store refuses for its values; the rest of its batch was stored
    "buffer_full",  # without a spool, more rows waited in memory for a failing store than the bound allows
)


class _Dropped:
    """Process-wide counts of what was dropped, by kind (``spans``, ``metric_samples``) and reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, kind: str, n: int, reason: str) -> None:
        with self._lock:
            self.counts[(kind, reason)] = self.counts.get((kind, reason), 0) + n

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(n for (k, _), n in self.counts.items() if k == kind)

    def families(self, host: str) -> list:
        """``stagetrace_dropped_spans_total`` and ``stagetrace_dropped_metric_samples_total``, labelled ``host`` and
        ``reason`` (every reason, zero included, so that rate() and alerts see the series from the start)."""
        out = []
        for kind, text in (("spans", "Spans"), ("metric_samples", "Metric samples")):
            family = CounterMetricFamily(f"stagetrace_dropped_{kind}", f"{text} dropped before reaching the store.",
                                         labels=["host", "reason"])  # fmt: skip
            with self._lock:
                for reason in REASONS:
                    family.add_metric([host, reason], self.counts.get((kind, reason), 0))
            out.append(family)
        return out


DROPPED = _Dropped()


# --- locating the spool -------------------------------------------------------------------------------------


def max_bytes_setting(max_bytes: int | None = None) -> int:
    if max_bytes is not None:
        return int(max_bytes)
    raw = os.environ.get(ENV_SPOOL_MAX_BYTES)
    if raw:
        try:
            return int(float(raw))
        except ValueError:
            logger.warning("ignoring %s=%r: not a number of bytes; using %d", ENV_SPOOL_MAX_BYTES, raw, DEFAULT_MAX_BYTES)
    return DEFAULT_MAX_BYTES


def directory_setting(location, directory: str | os.PathLike | None = None) -> Path | None:
    """The spool's base directory for a store ``location``; None when there is to be no spool."""
    chosen = directory if directory is not None else os.environ.get(ENV_SPOOL_DIR)
    if chosen is not None:
        text = os.fspath(chosen)
        return None if text.strip().lower() in ("", "off", "none") else Path(text).expanduser()
    if location.embedded:
        return Path(f"{location.path}.spool") if location.path else None
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "stagetrace" / "spool" / f"{location.host}-{location.port}-{location.database}"


def open_spool(location, kind: str, directory=None, max_bytes: int | None = None, handoff: bool = False) -> Spool | None:
    """The spool for writer ``kind`` (``spans``, ``metrics``) of the store at ``location``, or None; ``handoff``:
    into the inbox that the process holding the store adopts."""
    base = directory_setting(location, directory)
    return Spool(base / kind, max_bytes_setting(max_bytes), handoff) if base is not None else None


# --- the spool ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    path: Path
    table: str
    rows: int
    size: int


@dataclass
class Batch:
    table: str
    columns: tuple[str, ...]
    rows: list
    token: str


class Spool:
    """A bounded, ordered on-disk queue of batches under ``base`` (see the module docstring)."""

    def __init__(self, base: Path, max_bytes: int = DEFAULT_MAX_BYTES, handoff: bool = False):
        self.max_bytes = max_bytes
        self.base = Path(base)
        self.handoff = handoff
        self.dropped_rows = 0  # by this spool; DROPPED has the process-wide count
        self.on_drop: Callable[[Segment], None] | None = None  # told of each segment dropped
        self._lock = threading.Lock()
        self._seq = 0
        try:
            if handoff:  # for the process that holds the store: its adopt() takes them, whenever it runs
                self.directory, self._lock_fd, self._segments = self.base / INBOX, None, []
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            else:
                self.directory, self._lock_fd = _claim(self.base)
                self._segments = self._scan()
                self.adopt()
        except OSError as exc:
            raise SpoolError(
                f"cannot use the spool directory {base}: {exc.strerror or exc} "
                f"(choose another with {ENV_SPOOL_DIR}, or {ENV_SPOOL_DIR}=off)"
            ) from None
        if self._segments:
            logger.warning("spool %s holds %d rows from an earlier run; replaying them", self.directory, self.rows())

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

    # writing

    def put(self, table: str, columns, rows: list, token: str) -> Segment | None:
        """Add a batch durably; None when it was dropped (and counted): larger than the whole spool, or the
        disk refused the write (full, read-only, failing)."""
        data = zlib.compress(
            json.dumps({"v": _FORMAT, "table": table, "columns": list(columns), "token": token, "rows": rows},
                       separators=(",", ":"), default=str).encode("utf-8", "surrogatepass"),
            1,
        )  # fmt: skip
        with self._lock:
            if len(data) > self.max_bytes:
                self._count_dropped(table, len(rows), "spool_full",
                                    f"a batch of {len(data)} bytes is larger than the whole spool")  # fmt: skip
                return None
            dropped = self._make_room(len(data))
            self._seq = max(self._seq + 1, time.time_ns())
            segment = Segment(self.directory / f"{self._seq:020d}.{table}.{len(rows)}.seg", table, len(rows), len(data))
            try:
                _write_atomically(segment.path, data)
            except OSError as exc:  # the writer thread must survive a full or failing disk
                self._count_dropped(table, len(rows), "spool_write_failed",
                                    f"cannot write {segment.path.name}: {exc.strerror or exc}")  # fmt: skip
                segment = None
            else:
                if not self.handoff:
                    self._segments.append(segment)
        self._notify_dropped(dropped)
        return segment

    def load(self, segment: Segment) -> Batch | None:
        """The batch in ``segment``; None (and the segment dropped and counted) when it cannot be read."""
        try:
            doc = json.loads(zlib.decompress(segment.path.read_bytes()).decode("utf-8", "surrogatepass"))
            return Batch(doc["table"], tuple(doc["columns"]), doc["rows"], doc["token"])
        except (OSError, ValueError, KeyError, TypeError, zlib.error) as exc:
            with self._lock:
                self._discard(segment)
                self._count_dropped(segment.table, segment.rows, "unreadable_segment",
                                    f"segment {segment.path.name} is unreadable ({exc})")  # fmt: skip
            self._notify_dropped([segment])
            return None

    def remove(self, segment: Segment) -> None:
        with self._lock:
            self._discard(segment)

    def replay(self, insert: Callable[[Batch], bool], table: str | None = None, limit: int | None = None) -> bool:
        """Insert spooled batches oldest first (of ``table``, at most ``limit``) until one fails.

        Returns True when none failed. ``insert`` must pass the batch's token so a repeat is dropped.
        """
        done = 0
        while limit is None or done < limit:
            segment = self.oldest(table)
            if segment is None:
                return True
            batch = self.load(segment)
            if batch is not None:
                if not insert(batch):
                    return False
                self.remove(segment)
            done += 1
        return True

    def close(self) -> None:
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the slot's flock
                self._lock_fd = None

    # internals (called with self._lock held)

    def _make_room(self, incoming: int) -> list[Segment]:
        total = sum(s.size for s in self._segments)
        dropped = []
        while self._segments and total + incoming > self.max_bytes:
            oldest = self._segments[0]
            total -= oldest.size
            self._discard(oldest)
            dropped.append(oldest)
        for segment in dropped:
            self._count_dropped(segment.table, segment.rows, "spool_full", f"the spool is full ({self.max_bytes} bytes)")
        return dropped

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

    def _count_dropped(self, table: str, rows: int, reason: str, why: str) -> None:
        kind = "spans" if table == "otel_traces" else "metric_samples"
        self.dropped_rows += rows
        DROPPED.add(kind, rows, reason)
        advice = f" (raise {ENV_SPOOL_MAX_BYTES})" if reason == "spool_full" else ""
        logger.error("spool %s: dropped %d %s: %s%s", self.directory, rows, kind.replace("_", " "), why, advice)

    def _scan(self) -> list[Segment]:
        segments = []
        for entry in os.scandir(self.directory):
            match = _SEGMENT.match(entry.name)
            if match:
                segments.append(Segment(Path(entry.path), match[2], int(match[3]), entry.stat().st_size))
                self._seq = max(self._seq, int(match[1]))
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write cut short by a crash: never renamed, so never acknowledged
        return sorted(segments, key=lambda s: s.path.name)

    def adopt(self) -> int:
        """Move the segments of slots no process holds (a writer that died or exited with segments left) into
        this one, keeping their time order; how many were adopted."""
        adopted = 0
        for slot in sorted(p for p in self.base.iterdir() if p.is_dir() and p != self.directory):
            fd = None
            if slot.name != INBOX:  # segments in the inbox are whole and handed over: no lock to take
                try:
                    fd = _lock_slot(slot)
                except BlockingIOError:
                    continue  # a live writer holds it
            try:
                for entry in os.scandir(slot):
                    if _SEGMENT.match(entry.name):
                        with contextlib.suppress(FileNotFoundError):  # another adopter took it first
                            os.rename(entry.path, self.directory / entry.name)
                            adopted += 1
            finally:
                if fd is not None:
                    os.close(fd)
        if adopted:
            with self._lock:
                self._segments = self._scan()
        return adopted


def _lock_slot(slot: Path) -> int:
    fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim(base: Path) -> tuple[Path, int]:
    """The first slot under ``base`` no other process holds, and the locked descriptor that holds it."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)  # spans may carry what operators consider private
    for n in range(MAX_SLOTS):
        slot = base / str(n)
        slot.mkdir(exist_ok=True, mode=0o700)
        try:
            return slot, _lock_slot(slot)
        except BlockingIOError:
            continue
    raise OSError(0, f"all {MAX_SLOTS} slots are held by other processes")


def _write_atomically(path: Path, data: bytes) -> None:
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


__all__ = ["Batch", "DROPPED", "REASONS", "ENV_SPOOL_DIR", "ENV_SPOOL_MAX_BYTES", "Segment", "Spool", "SpoolError",
           "directory_setting", "new_token", "open_spool"]  # fmt: skip
