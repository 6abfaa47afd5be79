"""Durable spool: batches the store did not take, on disk, replayed in order once it takes inserts again.

A writer gives every batch a deduplication token before its first insert attempt and keeps it with the
batch in the spool, so a replay of a batch the store took after all (an insert that timed out after the
server committed it) adds nothing: ClickHouse drops a block whose ``insert_deduplication_token`` it has
seen among the last ``non_replicated_deduplication_window`` blocks of the table (the schema sets it).

Layout: ``<directory>/<kind>/<slot>/<seq>.<table>.<rows>.seg``, one zlib-compressed JSON batch per segment,
written to a temporary file, fsynced, then renamed into place, so a segment is whole or absent even after
kill -9 or a power cut.

The OTLP receivers write **write-ahead records** instead: each request as it arrived (protobuf), named
``<seq>.<record kind>.<rows>.<request token>.wal``, fsynced before the request is answered. The writer's
replay thread turns the oldest records into rows and inserts them together, so many small requests make one
insert; before that insert it *seals* them as a group (renames each to ``….<request token>.<group token>.wal``),
and the group's token is the insert's deduplication token, so a replay after a crash inserts the same group
under the same token and adds nothing. The tokens of the requests stored are kept (``<slot>/landed``, the
last ``RECENT_TOKENS``), so a sender's retry of a request whose answer it never got is recognised and not
stored twice. Records are never dropped to make room: a full spool refuses the request (the sender retries).

A process holds its slot by an flock on ``<slot>/lock``; the next free slot goes to the next process writing
the same store, and a process adopts the segments of slots nobody holds (a
predecessor that died), so what a dead process spooled is replayed by whoever writes next. A process that
cannot write the store because the agent holds it writes into ``<kind>/inbox`` instead, which the agent's
writers adopt every few seconds.

The spool is bounded by ``max_bytes``; when a new batch would exceed it, the oldest segments are dropped,
counted in ``stagetrace_dropped_spans_total`` / ``stagetrace_dropped_metric_samples_total`` (by ``reason``)
and logged.

**Kept after storing.** A group of records, once stored, is not deleted but moved into ``<directory>/<kind>/kept``
(renamed ``….kept``: nothing replays it), where the newest ``STAGETRACE_SPOOL_KEEP_BYTES`` (64 MiB, at most 2% of
the filesystem; ``0``: none) stay, the oldest deleted first. They are what restores the rows of a part the engine
loses (``exporters.restore``): a part that a disk fault or a power cut leaves broken holds rows that were
acknowledged long ago, whose records would be gone otherwise. A rename instead of an unlink: the cost is the disk.

**Groups sealed by an earlier process** (found sealed at start or adopted) may have been stored already: their
insert fsyncs the part, but neither the engine's deduplication log (which the token relies on) nor the records'
removal is fsynced, so a power cut or a filesystem that turns read-only (its journal aborted) can forget both.
``head_group`` says so (``inherited``), and the writer stores only the rows the table does not hold yet.

Settings are arguments with environment fallbacks: ``STAGETRACE_SPOOL_DIR`` (``off`` disables the spool),
``STAGETRACE_SPOOL_MAX_BYTES`` (256 MiB), ``STAGETRACE_SPOOL_KEEP_BYTES``. The default directory is beside an embedded store on disk
(``<store>.spool``), else ``$XDG_STATE_HOME/stagetrace/spool/<host>-<port>-<database>``; an in-memory
store, which does not outlive the process, has no spool.
"""

from __future__ import annotations

import collections
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
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from stagetrace.environment_variables import (
    STAGETRACE_SPOOL_DIR, STAGETRACE_SPOOL_KEEP_BYTES, STAGETRACE_SPOOL_MAX_BYTES,
)  # fmt: skip
from stagetrace.exporters.diskspace import Spell
from stagetrace.settings import parse_size
from stagetrace.store import StoreError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# 64 MiB of requests as they arrived: some 300,000 spans of the benchmarks' batches, minutes of a busy node and
# hours of a quiet one; the 2% cap keeps a small volume (a test's tmpfs) from filling with it
DEFAULT_KEEP_BYTES = 64 * 1024 * 1024
KEEP_FRACTION_CAP = 0.02
KEPT = "kept"  # under the base: stored records, kept to restore a part the engine loses
MAX_SLOTS = 64
INBOX = "inbox"  # where a process that cannot write the store (held by the agent) hands its batches over
# batches: <seq>.<table>.<rows>.seg; write-ahead records: <seq>.<kind>.<rows>.<token>[.<group>].wal
_SEGMENT = re.compile(r"^(\d{20})\.([A-Za-z_][A-Za-z0-9_]*)\.(\d+)(?:\.seg|\.([0-9a-f]{32})(?:\.([0-9a-f]{32}))?\.wal)$")
_KEPT_NAME = re.compile(r"^(\d{20})\.([A-Za-z_][A-Za-z0-9_]*)\.(\d+)\.([0-9a-f]{32})\.([0-9a-f]{32})\.kept$")
_FORMAT = 1
RECENT_TOKENS = 20_000  # request tokens remembered for recognising a sender's retry: minutes of a busy agent
LANDED = "landed"  # per slot: the tokens of requests stored, one per line


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


def dropped_kind(table: str) -> str:
    """What the rows of ``table`` (or of a write-ahead record kind) are counted as when dropped."""
    if table in ("otel_traces", "otlp_traces"):
        return "spans"
    return "log_records" if table in ("otel_logs", "otlp_logs") else "metric_samples"


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
        """``stagetrace_dropped_spans_total``, ``..._metric_samples_total`` and ``..._log_records_total``, labelled ``host`` and
        ``reason`` (every reason, zero included, so that rate() and alerts see the series from the start)."""
        out = []
        for kind, text in (("spans", "Spans"), ("metric_samples", "Metric samples"), ("log_records", "Log records")):
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
    raw = os.environ.get(STAGETRACE_SPOOL_MAX_BYTES)
    if raw:
        try:
            return parse_size(raw)
        except ValueError as exc:
            logger.warning("ignoring %s: %s; using %d bytes", STAGETRACE_SPOOL_MAX_BYTES, exc, DEFAULT_MAX_BYTES)
    return DEFAULT_MAX_BYTES


def keep_bytes_setting(base: Path, keep_bytes: int | None = None) -> int:
    """How many bytes of stored records to keep under ``base`` (see the module docstring)."""
    if keep_bytes is None:
        raw = os.environ.get(STAGETRACE_SPOOL_KEEP_BYTES)
        keep_bytes = DEFAULT_KEEP_BYTES
        if raw:
            try:
                return parse_size(raw, zero=True)
            except ValueError as exc:
                logger.warning("ignoring %s: %s; using %d bytes", STAGETRACE_SPOOL_KEEP_BYTES, exc, keep_bytes)
        try:
            stats = os.statvfs(base)
            keep_bytes = min(keep_bytes, int(stats.f_blocks * stats.f_frsize * KEEP_FRACTION_CAP))
        except OSError:
            pass
    return max(0, int(keep_bytes))


def kept_records(base: Path) -> list[Segment]:
    """The stored records kept under ``base`` (a spool's ``<directory>/<kind>``), oldest first."""
    try:
        entries = list(os.scandir(Path(base) / KEPT))
    except OSError:
        return []
    kept = []
    for entry in entries:
        match = _KEPT_NAME.match(entry.name)
        if match is not None:
            with contextlib.suppress(OSError):
                kept.append(Segment(Path(entry.path), match[2], int(match[3]), entry.stat().st_size, match[4], match[5]))
    return sorted(kept, key=lambda s: s.path.name)


def pending_records(base: Path) -> list[Segment]:
    """The write-ahead records under ``base`` (a spool's ``<directory>/<kind>``) not stored yet, or stored and not
    yet retired, in every slot, oldest first."""
    pending = []
    for slot in sorted(Path(base).glob("*/")):
        if slot.name == KEPT:
            continue
        with contextlib.suppress(OSError):
            for entry in os.scandir(slot):
                segment = Segment.named(Path(entry.path), 0) if entry.name.endswith(".wal") else None
                if segment is not None:
                    pending.append(segment)
    return sorted(pending, key=lambda s: s.path.name)


def directory_setting(location, directory: str | os.PathLike | None = None) -> Path | None:
    """The spool's base directory for a store ``location``; None when there is to be no spool."""
    chosen = directory if directory is not None else os.environ.get(STAGETRACE_SPOOL_DIR)
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
        match = _SEGMENT.match(path.name)
        if match is None:
            return None
        return cls(path, match[2], int(match[3]), size, match[4] or "", match[5] or "")


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
        self._recent: dict[str, None] = {}  # request tokens of records written or stored, oldest first
        self._landed_fd: int | None = None
        self._landed_lines = 0
        self._refusal: tuple[str, Spell] | None = None  # why requests are being refused, while they are
        self._put_failing = False  # the last batch could not be written
        self._retire_failing = False  # stored records could not be removed (a read-only disk), said once
        self._sealed_here: set[str] = set()  # groups this process sealed (the others may be stored already)
        self._seal_failing = False
        self._kept: collections.deque[tuple[Path, int]] = collections.deque()
        self._kept_bytes = 0
        self.keep_bytes = 0
        try:
            if handoff:  # for the process that holds the store: its adopt() takes them, whenever it runs
                self.directory, self._lock_fd, self._segments = self.base / INBOX, None, []
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            else:
                self.directory, self._lock_fd = _claim(self.base)
                self.keep_bytes = keep_bytes_setting(self.base)
                for kept in kept_records(self.base):
                    self._kept.append((kept.path, kept.size))
                    self._kept_bytes += kept.size
                self._segments = self._scan()
                self.adopt()
                self._load_landed()
        except OSError as exc:
            raise SpoolError(
                f"cannot use the spool directory {base}: {exc.strerror or exc} "
                f"(choose another with {STAGETRACE_SPOOL_DIR}, or {STAGETRACE_SPOOL_DIR}=off)"
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
                # logged once until a write works again: a writer retries each interval
                self._count_dropped(table, len(rows), "spool_write_failed",
                                    f"cannot write {segment.path.name}: {exc.strerror or exc}",
                                    quiet=self._put_failing)  # fmt: skip
                self._put_failing = True
                segment = None
            else:
                if self._put_failing:
                    logger.warning("spool %s: writes work again", self.directory)
                    self._put_failing = False
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
            self.unreadable(segment, exc)
            return None

    def remove(self, segment: Segment) -> None:
        with self._lock:
            self._discard(segment)

    def replay(self, insert: Callable[[Batch], bool], table: str | None = None, limit: int | None = None) -> bool:
        """Insert spooled batches oldest first (of ``table``, at most ``limit``) until one fails or a write-ahead
        record comes first (the writer inserts those, see ``head_group``).

        Returns True when none failed. ``insert`` must pass the batch's token so a repeat is dropped.
        """
        done = 0
        while limit is None or done < limit:
            segment = self.oldest(table)
            if segment is None or segment.record:
                return True
            batch = self.load(segment)
            if batch is not None:
                if not insert(batch):
                    return False
                self.remove(segment)
            done += 1
        return True

    # write-ahead records

    def known(self, token: str) -> bool:
        """Whether a request with ``token`` is already durable here: written as a record, or stored."""
        with self._lock:
            return token in self._recent

    def put_record(self, kind: str, payload: bytes, rows: int, token: str) -> Segment | None:
        """Write one request as received, fsynced; None when the spool is full or the disk refused it. Nothing
        is dropped then: the caller must not acknowledge the request, whose sender retries it."""
        with self._lock:
            if sum(s.size for s in self._segments) + len(payload) > self.max_bytes:
                self._refusing("full", logging.WARNING, "spool %s is full (%d bytes): refusing requests until the "
                               "store takes the backlog (raise %s)", self.directory, self.max_bytes,
                               STAGETRACE_SPOOL_MAX_BYTES)  # fmt: skip
                return None
            self._seq = max(self._seq + 1, time.time_ns())
            segment = Segment(self.directory / f"{self._seq:020d}.{kind}.{rows}.{token}.wal", kind, rows,
                              len(payload), token)  # fmt: skip
            try:
                _write_atomically(segment.path, payload)
            except OSError as exc:
                self._refusing("unwritable", logging.ERROR, "spool %s: cannot write requests (%s): refusing them until "
                               "it can", self.directory, exc.strerror or exc)  # fmt: skip
                return None
            self._segments.append(segment)
            self._remember(token)
            self._taking()
        return segment

    def _refusing(self, why: str, level: int, message: str, *args) -> None:
        """A request refused: the first of a spell is logged, the others counted (never a line per request)."""
        if self._refusal is not None and self._refusal[0] != why:
            self._taking()  # from full to unwritable, or back: each spell its own pair of lines
        if self._refusal is None:
            self._refusal = (why, Spell(logger))
            self._refusal[1].begin(level, message, *args)
        self._refusal[1].refused += 1

    def _taking(self) -> None:
        if self._refusal is not None:
            why, spell = self._refusal
            self._refusal = None
            lasted, refused = spell.end()
            state = "full" if why == "full" else "its disk refused writes"
            logger.warning("spool %s takes requests again after %.1f s (%s meanwhile: refused %d requests)",
                           self.directory, lasted, state, refused)  # fmt: skip

    def head_group(self, max_rows: int) -> tuple[str, list[Segment]]:
        """The group of write-ahead records at the head of the spool, and its token: a group sealed earlier
        (whole, or what is left of it after a crash), else the oldest records of one kind up to ``max_rows``,
        sealed now. Empty when the head is a batch, or sealing failed."""
        with self._lock:
            head = self._segments[0] if self._segments else None
            if head is None or not head.record:
                return "", []
            if head.group:
                return head.group, [s for s in self._segments if s.group == head.group]
            group, members, rows = new_token(), [], 0
            for i, segment in enumerate(self._segments):
                if not segment.record or segment.group or segment.table != head.table:
                    break
                if members and rows + segment.rows > max_rows:
                    break
                sealed = replace(segment, path=segment.path.with_name(f"{segment.path.name[:-4]}.{group}.wal"),
                                 group=group)  # fmt: skip
                try:
                    os.rename(segment.path, sealed.path)
                except OSError as exc:
                    if not self._seal_failing:  # the replay retries with back-off: one line until it works
                        logger.error("spool %s: cannot seal %s: %s", self.directory, segment.path.name,
                                     exc.strerror or exc)  # fmt: skip
                    self._seal_failing = True
                    break
                self._seal_failing = False
                self._sealed_here.add(group)
                self._segments[i] = sealed
                members.append(sealed)
                rows += segment.rows
            return (group, members) if members else ("", [])

    def inherited(self, group: str) -> bool:
        """Whether ``group`` was sealed by an earlier process, so that its rows may be in the store already."""
        with self._lock:
            return group not in self._sealed_here

    def read_record(self, segment: Segment) -> bytes | None:
        """A record's request; None (and the record dropped and counted) when it cannot be read."""
        try:
            return segment.path.read_bytes()
        except OSError as exc:
            self.unreadable(segment, exc)
            return None

    def unreadable(self, segment: Segment, why) -> None:
        """Drop a segment that cannot be read or decoded, counted."""
        with self._lock:
            self._discard(segment)
            self._count_dropped(segment.table, segment.rows, "unreadable_segment",
                                f"segment {segment.path.name} is unreadable ({why})")  # fmt: skip
        self._notify_dropped([segment])

    def landed(self, members: list[Segment]) -> None:
        """The records of a group are in the store: remember their tokens (a sender's retry), then keep them (see
        the module docstring) or remove them. A disk that refuses (read-only) leaves them where they are: the next
        process finds the group sealed by another and stores only what the store lacks."""
        with self._lock:
            try:
                if self._landed_fd is not None:
                    # no fsync: a retry the next owner does not recognise after a power cut is stored twice, at worst
                    os.write(self._landed_fd, "".join(f"{s.token}\n" for s in members).encode())
                    self._landed_lines += len(members)
                    if self._landed_lines > 2 * RECENT_TOKENS:
                        self._rewrite_landed()
                for segment in members:
                    self._retire(segment)
            except OSError as exc:
                if not self._retire_failing:
                    logger.error("spool %s: cannot remove records already stored (%s): they stay, and are checked "
                                 "against the store when the spool is next opened", self.directory,
                                 exc.strerror or exc)  # fmt: skip
                self._retire_failing = True
            else:
                if self._retire_failing:
                    logger.warning("spool %s: stored records are removed again", self.directory)
                self._retire_failing = False
            for segment in members:
                if segment in self._segments:
                    self._segments.remove(segment)
                self._sealed_here.discard(segment.group)
            self._forget_kept()

    def _retire(self, segment: Segment) -> None:
        if not self.keep_bytes or not segment.group:
            self._discard(segment)
            return
        kept = self.base / KEPT / f"{segment.path.name[:-4]}.kept"
        try:
            os.rename(segment.path, kept)
        except FileNotFoundError:
            if segment.path.exists():  # the first of them: make the folder
                kept.parent.mkdir(exist_ok=True, mode=0o700)
                os.rename(segment.path, kept)
            else:
                return
        self._kept.append((kept, segment.size))
        self._kept_bytes += segment.size

    def _forget_kept(self) -> None:
        while self._kept and self._kept_bytes > self.keep_bytes:
            path, size = self._kept.popleft()
            self._kept_bytes -= size
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.unlink()
                except OSError:
                    self._kept.appendleft((path, size))
                    self._kept_bytes += size
                    return

    def close(self) -> None:
        with self._lock:
            if self._landed_fd is not None:
                os.close(self._landed_fd)
                self._landed_fd = None
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

    def _count_dropped(self, table: str, rows: int, reason: str, why: str, quiet: bool = False) -> None:
        kind = dropped_kind(table)
        self.dropped_rows += rows
        DROPPED.add(kind, rows, reason)
        if quiet:
            return
        advice = f" (raise {STAGETRACE_SPOOL_MAX_BYTES})" if reason == "spool_full" else ""
        logger.error("spool %s: dropped %d %s: %s%s", self.directory, rows, kind.replace("_", " "), why, advice)

    def _scan(self) -> list[Segment]:
        segments = []
        for entry in os.scandir(self.directory):
            segment = Segment.named(Path(entry.path), 0)
            if segment is not None:
                segments.append(replace(segment, size=entry.stat().st_size))
                self._seq = max(self._seq, int(entry.name[:20]))
                if segment.record:
                    self._remember(segment.token)
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write cut short by a crash: never renamed, so never acknowledged
        return sorted(segments, key=lambda s: s.path.name)

    def _remember(self, token: str) -> None:
        self._recent[token] = None
        if len(self._recent) > RECENT_TOKENS:
            del self._recent[next(iter(self._recent))]

    def _load_landed(self) -> None:
        """The tokens of requests stored by this slot's earlier owners and by the slots' around it (a restarted
        agent may get another slot), then this slot's file rewritten to the window and kept open for appending."""
        for path in sorted(self.base.glob(f"*/{LANDED}")):
            with contextlib.suppress(OSError):
                for line in path.read_text("ascii", "replace").split():
                    self._remember(line)
        self._rewrite_landed()

    def _rewrite_landed(self) -> None:
        if self._landed_fd is not None:
            os.close(self._landed_fd)
        path = self.directory / LANDED
        data = "".join(f"{token}\n" for token in self._recent).encode()
        tmp = path.with_name(f".{LANDED}.tmp")
        tmp.write_bytes(data)
        os.rename(tmp, path)
        self._landed_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._landed_lines = len(self._recent)

    def adopt(self) -> int:
        """Move the segments of slots no process holds (a writer that died or exited with segments left) into
        this one, keeping their time order; how many were adopted."""
        adopted = 0
        for slot in sorted(p for p in self.base.iterdir() if p.is_dir() and p != self.directory and p.name != KEPT):
            fd = None
            if slot.name != INBOX:  # segments in the inbox are whole and handed over: no lock to take
                try:
                    fd = _lock_slot(slot)
                except BlockingIOError:
                    continue  # a live writer holds it
            try:
                for entry in os.scandir(slot):
                    if _SEGMENT.match(entry.name):  # records keep their names: a sealed group stays one
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


__all__ = ["Batch", "DROPPED", "REASONS", "KEPT",
           "Segment", "Spool", "SpoolError", "directory_setting", "dropped_kind", "keep_bytes_setting", "kept_records", "new_token", "open_spool",
           "pending_records"]  # fmt: skip
