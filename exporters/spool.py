"""The durable spool: batches the store did not take, on disk, replayed in order once it takes inserts again.

A writer gives every batch a deduplication token before its first insert attempt and keeps it with the batch in the
spool, so a replay of a batch the store took after all (an insert that timed out after the server committed it)
adds nothing: ClickHouse drops a block whose ``insert_deduplication_token`` it has seen among the last
``non_replicated_deduplication_window`` blocks of the table (the schema sets it).

Layout: ``<directory>/<kind>/<slot>/<seq>.<table>.<rows>.seg``, one zlib-compressed JSON batch per segment
(``exporters.segments``), beside the OTLP receivers' write-ahead records (``exporters.wal``). A process holds its
slot by an flock on ``<slot>/lock``; a process adopts the segments of slots nobody holds (a predecessor that died),
and one that cannot write the store because the agent holds it writes into ``<kind>/inbox``, which the agent's
writers adopt every few seconds. When a new batch would exceed ``max_bytes``, the oldest segments are dropped,
counted (``exporters.dropped``) and logged.

Settings: ``STAGETRACE_SPOOL_DIR`` (``off`` disables the spool), ``STAGETRACE_SPOOL_MAX_BYTES`` (256 MiB),
``STAGETRACE_SPOOL_KEEP_BYTES`` (``exporters.kept``). The default directory is beside an embedded store on disk
(``<store>.spool``), else ``$XDG_STATE_HOME/stagetrace/spool/<host>-<port>-<database>``; an in-memory store, which
does not outlive the process, has no spool.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from stagetrace.environment_variables import STAGETRACE_SPOOL_DIR, STAGETRACE_SPOOL_MAX_BYTES
from stagetrace.exporters.dropped import DROPPED, REASONS, dropped_kind
from stagetrace.exporters.kept import KEPT, KeptRecords, keep_bytes_setting, kept_records
from stagetrace.exporters.segments import SEGMENT_NAME, Segment, new_token, write_atomically
from stagetrace.exporters.wal import WriteAheadLog, pending_records
from stagetrace.settings import parse_size
from stagetrace.store import StoreError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
MAX_SLOTS = 64
INBOX = "inbox"  # where a process that cannot write the store (held by the agent) hands its batches over
_FORMAT = 1


class SpoolError(StoreError):
    """The spool directory cannot be used; the message says which and what to do (a StoreError: the
    commands report it as they report a store they cannot use)."""


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


def open_spool(
    location, kind: str, directory=None, max_bytes: int | None = None, handoff: bool = False
) -> Spool | None:
    """The spool for writer ``kind`` (``spans``, ``metrics``) of the store at ``location``, or None; ``handoff``:
    into the inbox that the process holding the store adopts."""
    base = directory_setting(location, directory)
    return Spool(base / kind, max_bytes_setting(max_bytes), handoff) if base is not None else None


# --- the spool ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    table: str
    columns: tuple[str, ...]
    rows: list
    token: str


class Spool(WriteAheadLog):
    """A bounded, ordered on-disk queue of batches and write-ahead records under ``base`` (see the module
    docstring)."""

    def __init__(self, base: Path, max_bytes: int = DEFAULT_MAX_BYTES, handoff: bool = False):
        self.base = Path(base)
        self.handoff = handoff
        self._lock_fd: int | None = None
        self._put_failing = False  # the last batch could not be written
        try:
            if handoff:  # for the process that holds the store: its adopt() takes them, whenever it runs
                directory = self.base / INBOX
                directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                super().__init__(directory, max_bytes)
            else:
                directory, self._lock_fd = _claim(self.base)
                super().__init__(directory, max_bytes, KeptRecords(self.base, keep_bytes_setting(self.base)))
                self._segments = self._scan()
                self.adopt()
                self._tokens.load(self.base, self.directory)
        except OSError as exc:
            raise SpoolError(
                f"cannot use the spool directory {base}: {exc.strerror or exc} "
                f"(choose another with {STAGETRACE_SPOOL_DIR}, or {STAGETRACE_SPOOL_DIR}=off)"
            ) from None
        if self._segments:
            logger.warning("spool %s holds %d rows from an earlier run; replaying them", self.directory, self.rows())

    # batches

    def put(self, table: str, columns, rows: list, token: str) -> Segment | None:
        """Add a batch durably; None when it was dropped (and counted): larger than the whole spool, or the
        disk refused the write (full, read-only, failing)."""
        data = zlib.compress(
            json.dumps(
                {"v": _FORMAT, "table": table, "columns": list(columns), "token": token, "rows": rows},
                separators=(",", ":"),
                default=str,
            ).encode("utf-8", "surrogatepass"),
            1,
        )
        with self._lock:
            if len(data) > self.max_bytes:
                self._count_dropped(
                    table, len(rows), "spool_full", f"a batch of {len(data)} bytes is larger than the whole spool"
                )
                return None
            dropped = self._make_room(len(data))
            segment = Segment(
                self.directory / f"{self._next_seq():020d}.{table}.{len(rows)}.seg", table, len(rows), len(data)
            )
            try:
                write_atomically(segment.path, data)
            except OSError as exc:  # the writer thread must survive a full or failing disk
                # logged once until a write works again: a writer retries each interval
                self._count_dropped(
                    table,
                    len(rows),
                    "spool_write_failed",
                    f"cannot write {segment.path.name}: {exc.strerror or exc}",
                    quiet=self._put_failing,
                )
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

    def close(self) -> None:
        with self._lock:
            self._tokens.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the slot's flock
                self._lock_fd = None

    # slots

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
                    if SEGMENT_NAME.match(entry.name):  # records keep their names: a sealed group stays one
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
            self._count_dropped(
                segment.table, segment.rows, "spool_full", f"the spool is full ({self.max_bytes} bytes)"
            )
        return dropped

    def _scan(self) -> list[Segment]:
        segments = []
        for entry in os.scandir(self.directory):
            segment = Segment.named(Path(entry.path), 0)
            if segment is not None:
                segments.append(replace(segment, size=entry.stat().st_size))
                self._seq = max(self._seq, int(entry.name[:20]))
                if segment.record:
                    self._tokens.remember(segment.token)
            elif entry.name.endswith(".tmp"):
                os.unlink(entry.path)  # a write cut short by a crash: never renamed, so never acknowledged
        return sorted(segments, key=lambda s: s.path.name)


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


# the names the writers, the restorer, the agent and the tests import from here; the counter, the kept records and
# the write-ahead records live in their own modules
__all__ = [
    "Batch",
    "DEFAULT_MAX_BYTES",
    "DROPPED",
    "KEPT",
    "REASONS",
    "Segment",
    "Spool",
    "SpoolError",
    "directory_setting",
    "dropped_kind",
    "keep_bytes_setting",
    "kept_records",
    "max_bytes_setting",
    "new_token",
    "open_spool",
    "pending_records",
]
