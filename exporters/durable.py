"""One write path for whatever stagetrace stores: insert with a deduplication token, spool on failure, replay.

The span exporter, the agent's metric writer and both OTLP receivers write through a :class:`DurableWriter`.
``write`` returns True only once the rows are durable: in the store, or fsynced into the spool
(``exporters.spool``) when the store does not take them; an acknowledgement (``SUCCESS``, an OTLP 200) may
then be given. False means neither (no spool, or the disk refused it): the caller must not acknowledge.

* **Exactly once.** Every batch carries an ``insert_deduplication_token``: the caller's (an OTLP receiver
  derives it from the request body, so a sender's retry of a request that landed before the answer was lost
  adds nothing) or a fresh one. A spooled batch keeps its token, so a replay of a batch the store took after
  all (an insert that timed out after the commit, a kill between the insert and removing the segment) adds
  nothing either.
* **In order.** While a table has spooled batches, new batches of it go to the spool behind them; a replay
  thread inserts them oldest first, backing off while the store fails. It also adopts, every few seconds,
  the segments of writers that are gone (a process killed, or one that could not reach a store held by the
  agent), so they reach the store without waiting for a restart.
* **Write-ahead records** (the OTLP receivers): ``write_ahead`` fsyncs a request as it arrived and returns;
  the replay thread turns the oldest records into rows and inserts them together under their group's token
  (see ``exporters.spool``), so a request costs an fsync, not an insert, and many requests make one insert.
  A group sealed by an earlier process may be stored already with the engine's memory of its token lost (its
  deduplication log is not fsynced with the part): only the rows the table lacks are inserted
  (``exporters.restore.missing``).
  The writer of a kind hands its ``exporters.records.RecordKind`` (its name and the function that turns a record into
  rows); the replay decodes through the kinds' registry, so any writer replays any record and what a killed agent
  wrote ahead is stored by whichever process writes next.
* **A store held by the agent** (shared read-only through its query endpoint) takes no inserts: batches go
  into the spool's inbox, fsynced, and the agent's replay thread adopts and stores them within seconds.
* **Rows the store can never take** (the client cannot serialise them, or the engine rejects their values)
  are isolated by splitting the batch: every other row lands, each refused row is dropped, counted in
  ``stagetrace_dropped_spans_total{reason="rejected_row"}`` (or ``..._metric_samples_total``), and logged once
  per reason. A batch the store refuses as a whole (down, schema missing, its disk full: ClickHouse's
  ``NOT_ENOUGH_SPACE``, code 243, from a server or the embedded engine) is kept, never split: the store is
  unavailable, not the rows, and the batch is retried from the spool until it lands.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable

from clickhouse_connect.driver.exceptions import DataError

from stagetrace.errors import first_line
from stagetrace.exporters import restore, spool
from stagetrace.exporters.diskspace import Headroom
from stagetrace.exporters.inserts import insert_rows
from stagetrace.exporters.records import RecordKind, decoder
from stagetrace.store import Store

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
# Rows of write-ahead records inserted together, at most (a backlog's; a light load's groups are smaller): an insert
# pays the views' planning and a part in each table whatever its size, so larger groups cost less CPU a span, up to
# here (0.68-0.75x at 32,768 against 8,192 rows, for 18% more memory; 65,536: little more, for 65% more;
# benchmarks/RESULTS.md, issue 32)
MAX_GROUP_ROWS = 32_768
ADOPT_EVERY_S = 5.0  # how often the replay thread looks for the segments of writers that are gone

# Engine errors about the values of rows, not the store: a batch holding such a row is split to find it.
# CANNOT_PARSE_TEXT, CANNOT_PARSE_INPUT_ASSERTION_FAILED, CANNOT_PARSE_DATE, CANNOT_PARSE_DATETIME, TYPE_MISMATCH,
# ARGUMENT_OUT_OF_BOUND, CANNOT_CONVERT_TYPE, CANNOT_PARSE_NUMBER, INCORRECT_DATA, TOO_LARGE_STRING_SIZE,
# VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
ROW_ERROR_CODES = frozenset({6, 27, 38, 41, 53, 69, 70, 72, 117, 131, 321})
# Engine errors that say the store cannot take anything now, whatever the rows: the batch is kept and retried.
# NOT_ENOUGH_SPACE (a full disk, or the engine's free-space guard for inserts)
UNAVAILABLE_CODES = frozenset({243})
# What clickhouse-connect raises while serialising a value it cannot write into the column's type.
_CLIENT_ROW_ERRORS = (DataError, TypeError, AttributeError, ValueError, OverflowError, struct.error)


class _SerializationNoise(logging.Filter):
    """clickhouse-connect logs a traceback for each value it cannot serialise; the writer says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Error serializing column")


logging.getLogger("clickhouse_connect.driver.transform").addFilter(_SerializationNoise())


def row_error(exc: BaseException) -> str | None:
    """Why the store refused rows for their values (a reason to split the batch), or None: the store failed."""
    if isinstance(exc, _CLIENT_ROW_ERRORS):
        return f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "code", None)
    if code is None:  # chdb and the HTTP client carry the engine's code in the message
        text = str(exc)
        at = text.find("Code: ")
        digits = text[at + 6 :].split(".", 1)[0] if at >= 0 else ""
        code = int(digits) if digits.isdigit() else None
    if code in ROW_ERROR_CODES and code not in UNAVAILABLE_CODES:
        return first_line(exc)
    return None


class NoRoom(Exception):
    """A request refused because free space under the store or the spool is below the reserve (``diskspace``);
    the message says where and how much: the caller answers "retry later", as for a full spool."""


class _Refused(Exception):
    """An insert the store refused because of the rows' values."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Inserts:
    """Inserts into one table that log one line when they start failing and one when they work again."""

    def __init__(self, store: Store, what: str, guard: Callable[[], int] | None = None):
        self.store = store
        self.what = what  # what the rows are, for the log lines
        self.guard = guard  # the free bytes below which the engine refuses the insert (NOT_ENOUGH_SPACE)
        self.failing_since: float | None = None
        # the columns' types, asked of the store once: without them clickhouse-connect asks before every insert
        self._types: dict[tuple, list] = {}

    def __call__(self, table: str, rows: list, columns, token: str) -> bool:
        """True when inserted, False when the store failed; raises _Refused when it refused the rows' values."""
        settings = {"insert_deduplication_token": token}
        guard = self.guard() if self.guard is not None else 0
        if guard:  # the engine's own check, against the disk its parts go to
            settings["min_free_disk_bytes_to_perform_insert"] = guard
        try:
            key = (table, tuple(columns))
            types = self._types.get(key)
            if types is None:
                types = self._types[key] = self.store.client.create_insert_context(
                    table, column_names=list(columns), database=self.store.database
                ).column_types
            try:
                insert_rows(self.store, table, rows, columns, types, settings)
            except UnicodeEncodeError:
                # Checking every string on the hot path costs more than this rare retry.
                rows = _scrubbed(rows)
                insert_rows(self.store, table, rows, columns, types, settings)
        except Exception as exc:  # any driver or server error: refused rows are split out, the rest is kept
            reason = row_error(exc)
            if reason is not None:
                raise _Refused(reason) from None
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                text = first_line(exc)
                if self.store.location.password:  # a driver's message may quote the URL it used
                    text = text.replace(self.store.location.password, "***")
                logger.error(
                    "cannot insert %d %s into %s, will retry: %s",
                    len(rows),
                    self.what,
                    self.store.location.redacted(),
                    text,
                )
            return False
        if self.failing_since is not None:
            logger.warning(
                "inserts into %s work again after %.1f s (%s)",
                self.store.location.redacted(),
                time.monotonic() - self.failing_since,
                self.what,
            )
            self.failing_since = None
        return True


def _scrubbed(value):
    """``value`` with lone surrogates (a Python str may hold them, UTF-8 cannot) replaced, in rows of any shape."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_scrubbed(k): _scrubbed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrubbed(v) for v in value]
    return value


class DurableWriter:
    """Durable writes into one store (see the module docstring).

    ``kind`` names the spool (``spans``, ``metrics``); ``spool_dir``: False for none, None for
    ``STAGETRACE_SPOOL_DIR`` or beside the store; a store shared read-only by an agent still spools, for
    the agent to adopt. ``headroom`` (the agent's): below its reserve ``write_ahead`` raises NoRoom, batches are
    not spooled (``write`` returns False: the caller keeps them), and inserts into an embedded store carry the
    engine's guard. ``part_guard`` (the agent's ``part_guard.PartGuard``, an embedded store): a group of records is
    retired only once the parts its insert made were checked, and put back from the records if the engine
    committed one short.
    """

    def __init__(
        self,
        store: Store,
        kind: str,
        *,
        spool_dir=None,
        spool_max_bytes: int | None = None,
        headroom: Headroom | None = None,
        group_rows: int = MAX_GROUP_ROWS,
        part_guard=None,
    ):
        self.store = store
        self.group_rows = group_rows  # rows of write-ahead records replayed in one insert, at most
        # the agent's free-space reserve: requests refused below it, batches kept out of the spool, and the
        # engine's insert guard for an embedded store
        self.headroom = headroom
        self.part_guard = part_guard
        # a store the agent shares read-only takes no inserts: batches go to the spool's inbox, which it adopts
        self.handoff = store.read_only
        self.spool = (
            None
            if spool_dir is False
            else spool.open_spool(
                store.location, kind, None if spool_dir is True else spool_dir, spool_max_bytes, self.handoff
            )
        )
        self.handed_over = 0  # rows handed to the agent that holds the store
        self._handed: list = []  # segments handed over that the agent may not have taken yet
        self._inserts: dict[str, _Inserts] = {}
        self._warned: set[str] = set()  # refusal reasons already logged
        self._rejected = 0  # rows the store refused, dropped
        self._check_failing = False  # a replayed group could not be checked against the store (said once)
        self._cond = threading.Condition()
        self._replay_lock = threading.Lock()  # one replay at a time: the thread's or a flush's
        self._closed = False
        self._retry_at = 0.0
        self._backoff = 0.0
        self._thread: threading.Thread | None = None
        if self.spool is not None and not self.handoff:
            self._thread = threading.Thread(target=self._run, name=f"stagetrace-replay-{kind}", daemon=True)
            self._thread.start()

    @property
    def dropped_rows(self) -> int:
        """Rows this writer dropped: refused by the store, or dropped from a full spool."""
        return self._rejected + (self.spool.dropped_rows if self.spool is not None else 0)

    def spooled_rows(self, table: str | None = None) -> int:
        return self.spool.rows(table) if self.spool is not None else 0

    def write(self, table: str, columns, rows: list, token: str | None = None) -> bool:
        """Store ``rows`` durably; True once they are in the store or the fsynced spool (see the module docstring)."""
        if not rows:
            return True
        token = token or spool.new_token()  # before the first attempt: a replay of a batch that landed adds nothing
        if self.handoff:
            if self.spool is None or not self._spool(table, columns, rows, token):
                return False
            self.handed_over += len(rows)
            return True
        if self.spool is not None and self.spool.rows(table):  # behind a backlog of this table, in order
            return self._spool(table, columns, rows, token)
        if self.insert(table, columns, rows, token):
            return True
        return self.spool is not None and self._spool(table, columns, rows, token)

    def write_ahead(self, kind: RecordKind, payload: bytes, rows: int, token: str) -> bool:
        """Store one request of ``kind`` (``exporters.records``) durably; True once it is a fsynced record (or it
        was already: a sender's retry), or, without a spool or with the store held by the agent, once its rows
        are written as ``write`` writes them. False: refused (the caller answers "retry later"); NoRoom: refused
        because free space is below the reserve."""
        if self.headroom is not None and not self.headroom.admit():
            raise NoRoom(self.headroom.reason())
        if self.spool is None or self.handoff:
            return all(
                self.write(table, columns, table_rows, token)
                for table, (columns, table_rows) in kind.decode(payload).items()
            )
        if self.spool.known(token):
            return True
        if self.spool.put_record(kind.name, payload, rows, token) is None:
            return False
        with self._cond:
            self._cond.notify_all()
        return True

    def insert(self, table: str, columns, rows: list, token: str) -> bool:
        """Insert now, splitting out rows the store refuses; False when the store failed (nothing is spooled)."""
        inserts = self._inserts.get(table)
        if inserts is None:
            guard = self.headroom.engine_guard if self.headroom is not None and self.store.location.embedded else None
            inserts = self._inserts[table] = _Inserts(self.store, spool.dropped_kind(table).replace("_", " "), guard)
        try:
            return inserts(table, rows, columns, token)
        except _Refused as refused:
            return self._isolate(inserts, table, columns, rows, token, refused.reason)

    def _isolate(self, inserts: _Inserts, table: str, columns, rows: list, token: str, reason: str) -> bool:
        # Halves get tokens derived from the batch's, so a replay of the batch splits alike and what landed
        # before a failure is not stored twice.
        if len(rows) == 1:
            self._drop_refused(table, reason)
            return True
        half = len(rows) // 2
        for i, part in enumerate((rows[:half], rows[half:])):
            try:
                if not inserts(table, part, columns, f"{token}.{i}"):
                    return False
            except _Refused as refused:
                if not self._isolate(inserts, table, columns, part, f"{token}.{i}", refused.reason):
                    return False
        return True

    def _drop_refused(self, table: str, reason: str) -> None:
        kind = spool.dropped_kind(table)
        self._rejected += 1
        spool.DROPPED.add(kind, 1, "rejected_row")
        if reason not in self._warned:
            self._warned.add(reason)
            logger.error("dropped a row of %s the store refuses (%s); the rest of its batch is stored", table, reason)

    def _spool(self, table: str, columns, rows: list, token: str) -> bool:
        if self.headroom is not None and not self.headroom.room():
            return False  # the caller keeps them (the metric writer in memory) until there is room again
        segment = self.spool.put(table, columns, rows, token)
        if segment is not None and self.handoff:
            self._handed.append(segment.path)
        with self._cond:
            self._cond.notify_all()
        return segment is not None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Replay the spool now; True when nothing waits in it (handed over: when the agent has taken it all)."""
        if self.spool is None:
            return True
        deadline = time.monotonic() + timeout_s
        if self.handoff:
            while any(path.exists() for path in self._handed):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
            self._handed.clear()
            return True
        while len(self.spool) and time.monotonic() < deadline:
            if not self._replay_one():
                return False
        return not len(self.spool)

    def close(self) -> None:
        """Stop replaying and release the spool; what waits in it stays there for the next writer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.spool is not None:
            if self.handed_over:
                logger.warning(
                    "%d rows were handed to the agent that holds %s, through %s",
                    self.handed_over,
                    self.store.location.redacted(),
                    self.spool.directory,
                )
            elif len(self.spool):
                logger.warning("%d rows wait in the spool %s for the next run", self.spool.rows(), self.spool.directory)
            self.spool.close()

    def _replay_one(self) -> bool:
        with self._replay_lock:
            head = self.spool.oldest()
            if head is not None and head.record:
                return self._replay_records()
            return self.spool.replay(lambda b: self.insert(b.table, b.columns, b.rows, b.token), limit=1)

    def _replay_records(self) -> bool:
        if self.part_guard is None:
            return self._store_group()
        with self.part_guard.lock:  # no round of the guard between the insert and the retiring of its records
            return self._store_group()

    def _store_group(self) -> bool:
        group, members = self.spool.head_group(self.group_rows)
        if not members:
            return False
        tables: dict[str, tuple] = {}
        stored = []
        for segment in members:
            payload = self.spool.read_record(segment)
            if payload is None:
                continue
            try:
                decoded = decoder(segment.table)(payload)
            except Exception as exc:  # a record that does not decode (or of an unknown kind) cannot ever be stored
                self.spool.unreadable(segment, exc)
                continue
            for table, (columns, rows) in decoded.items():
                tables.setdefault(table, (columns, []))[1].extend(rows)
            stored.append(segment)
        inherited = self.spool.inherited(group)
        for table, (columns, rows) in tables.items():
            if rows and inherited:
                # sealed by an earlier process: perhaps stored already, and the engine's memory of the token lost
                # with an unsynced file (spool's docstring); the rows the table holds are not inserted again
                try:
                    rows = restore.missing(self.store, table, columns, rows)
                except Exception as exc:  # the store is down: the group waits, as for a failed insert
                    if not self._check_failing:
                        logger.error(
                            "cannot check %d replayed %s against %s, will retry: %s",
                            len(rows),
                            spool.dropped_kind(table).replace("_", " "),
                            self.store.location.redacted(),
                            first_line(exc),
                        )
                    self._check_failing = True
                    return False
                self._check_failing = False
            if rows and not self.insert(table, columns, rows, group):
                return False
        if self.part_guard is not None and not self.part_guard.verify():
            return False  # a part committed short is put back from these records first; they wait until it is
        self.spool.landed(stored)
        return True

    def _run(self) -> None:
        adopt_at = time.monotonic() + ADOPT_EVERY_S
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    if len(self.spool) and now >= self._retry_at:
                        break
                    if now >= adopt_at:
                        break
                    wake = min(adopt_at, self._retry_at if len(self.spool) else adopt_at)
                    self._cond.wait(max(0.01, wake - now))
                if self._closed:
                    return
            if time.monotonic() >= adopt_at:
                adopt_at = time.monotonic() + ADOPT_EVERY_S
                self.spool.adopt()
            if not len(self.spool):
                continue
            if self._replay_one():
                self._backoff = self._retry_at = 0.0
            else:
                self._backoff = min(MAX_BACKOFF_S, max(0.1, self._backoff * 2))
                self._retry_at = time.monotonic() + self._backoff


__all__ = ["DurableWriter", "NoRoom", "ROW_ERROR_CODES", "UNAVAILABLE_CODES", "row_error"]
