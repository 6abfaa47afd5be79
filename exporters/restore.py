"""Rows the store lost, put back from the spool's kept records, each once.

Two faults leave acknowledged rows that the engine's deduplication token cannot be trusted with:

* **A part the engine detaches as broken** (a data file truncated while the agent was down, a disk error, a power
  cut during a merge): its rows are no longer read. If other active parts cover its block range (a merge whose
  sources the engine put back), nothing is lost. Otherwise its rows are restored from the records the spool keeps
  after storing them (``exporters.spool``, ``kept/``): those whose time lies in the part's range and whose key
  the table no longer holds, attached as a part so that the views do not derive again what their own tables kept
  (the request index, stages and trace extents lost no part). The part's own files are not read: ClickHouse
  checks every file of a part against its checksums, and a truncated part cannot be attached (tried: ``ATTACH
  PART`` of a compact part whose ``data.bin`` lost its second half, copied into a scratch table of the same
  structure, fails with code 228, "data.bin has unexpected size: 1969 instead of 3939"), so its readable granules
  would have to be decoded by hand, for rows the kept records restore whole.
* **A group of records sealed by an earlier process**: it may be stored already, and the engine's memory of its
  token lost (its deduplication log is not fsynced with the part: a filesystem whose journal aborted, as when the
  kernel remounts it read-only on an error, stored such a group twice, measured). Only the rows the table lacks
  are inserted (``missing``).

Both identify a row by its key (``KEYS``): ``otel_traces`` by trace and span ID, which a sender never reuses. A
table without a key is left to the token alone, and its broken parts are reported, not restored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from stagetrace.schema import DURABLE_SETTINGS
from stagetrace.store import Store

logger = logging.getLogger("stagetrace.agent")

# table -> (its time column, the columns that identify a row)
KEYS = {"otel_traces": ("Timestamp", ("TraceId", "SpanId"))}
# table -> the kind of kept record whose rows go into it (``durable.RECORD_KINDS``)
SOURCES = {"otel_traces": "otlp_traces"}
CHECK_ROWS = 8192  # keys asked about in one query
RESTORED = "restored"  # under kept/: the parts restored already, one "<table>/<part>" a line

_PRESENT_SQL = """
SELECT {key_a:Identifier}, {key_b:Identifier} FROM {db:Identifier}.{table:Identifier}
WHERE {time:Identifier} BETWEEN fromUnixTimestamp64Nano({first:Int64}) AND fromUnixTimestamp64Nano({last:Int64})
  AND ({key_a:Identifier}, {key_b:Identifier}) IN {keys:Array(Tuple(String, String))}"""
_ACTIVE_BLOCKS_SQL = """
SELECT partition_id, min_block_number, max_block_number FROM system.parts
WHERE database = {db:String} AND table = {table:String} AND active"""
_DETACHED_BLOCKS_SQL = """
SELECT name, partition_id, min_block_number, max_block_number FROM system.detached_parts
WHERE database = {db:String} AND table = {table:String}"""

# the scratch table a restore fills: the table's columns, indices and keys, as a plain MergeTree (a replicated
# table's copy would share its replication path), so that its partitions can be attached to the table
SCRATCH_PREFIX = "_stagetrace_restore_"
_LAYOUT_SQL = """
SELECT primary_key, sorting_key, partition_key FROM system.tables WHERE database = {db:String} AND name = {table:String}"""
# names written in where the parser takes no parameter (after AS and FROM): the store's and this module's own
_SCRATCH_SQL = """
CREATE TABLE `{db}`.`{scratch}` AS `{db}`.`{table}`
ENGINE = MergeTree PARTITION BY {partition} PRIMARY KEY ({primary}) ORDER BY ({sorting})
SETTINGS {durable}"""
_DROP_SCRATCH_SQL = "DROP TABLE IF EXISTS {db:Identifier}.{scratch:Identifier}"
_SCRATCH_PARTITIONS_SQL = """
SELECT DISTINCT partition_id FROM system.parts WHERE database = {db:String} AND table = {scratch:String} AND active"""
_ATTACH_SQL = """
ALTER TABLE `{db}`.`{table}` ATTACH PARTITION ID {{partition:String}} FROM `{db}`.`{scratch}`"""


def _ns(value) -> int:
    if isinstance(value, datetime):
        return int(value.timestamp() * 1_000_000_000)
    return int(value)


def missing(store: Store, table: str, columns, rows: list) -> list:
    """The rows of ``rows`` whose key ``table`` does not hold (and each key once); all of them for a table
    without a key. Raises what the store raises: the caller retries."""
    if table not in KEYS or not rows:
        return rows
    time_column, (key_a, key_b) = KEYS[table]
    at, ia, ib = (list(columns).index(c) for c in (time_column, key_a, key_b))
    fresh, seen = [], set()
    for start in range(0, len(rows), CHECK_ROWS):
        chunk = rows[start : start + CHECK_ROWS]
        times = [_ns(row[at]) for row in chunk]
        keys = [(row[ia], row[ib]) for row in chunk]
        present = set(store.client.query(_PRESENT_SQL, parameters={
            "db": store.database, "table": table, "time": time_column, "key_a": key_a, "key_b": key_b,
            "first": min(times), "last": max(times), "keys": keys}).result_rows)  # fmt: skip
        for row, key in zip(chunk, keys):
            if key not in present and key not in seen:
                seen.add(key)
                fresh.append(row)
    return fresh


@dataclass
class Outcome:
    table: str
    parts: list[str]
    rows: int | None  # what the parts held, when every count is readable
    restored: int
    covered: list[str]  # parts whose blocks active parts cover: nothing to restore
    kept_since: datetime | None  # the oldest kept record

    def line(self) -> str:
        where = f"store: table {self.table}"
        if not self.parts:
            which = f"parts {', '.join(self.covered)} are" if len(self.covered) > 1 else f"part {self.covered[0]} is"
            return (f"{where}: {which} covered by active parts (a merge the engine undid): their rows are read from "
                    "them, nothing to restore")  # fmt: skip
        names = ", ".join(self.parts)
        if self.rows is not None and self.restored >= self.rows:
            return f"{where}: restored all {self.restored:,} rows of part {names} from the spool's kept records"
        since = (f"the kept records begin at {self.kept_since:%Y-%m-%d %H:%M:%S} UTC" if self.kept_since else
                 "the spool keeps no records")  # fmt: skip
        lost = (f"{self.rows - self.restored:,} of its {self.rows:,} rows could not be restored" if self.rows is not None
                else "the part's row count is unreadable, so others may be missing")  # fmt: skip
        return (f"{where}: restored {self.restored:,} rows of part {names} from the spool's kept records; {lost}: "
                f"{since} (STAGETRACE_SPOOL_KEEP_BYTES), and rows not received over OTLP are not kept")


def _names(parts) -> list[str]:
    """The parts' names as the engine made them, without the reason it detached them for."""
    return [p.name.removeprefix(p.reason + "_") for p in parts]


class Restorer:
    """Restores the rows of broken parts of ``store``'s tables from the records kept under ``kept_base`` (the
    receivers' spool, ``<spool>/spans``)."""

    def __init__(self, store: Store, kept_base: Path | None):
        self.store = store
        self.kept_base = Path(kept_base) if kept_base is not None else None
        self._done = self._load_done()

    def _load_done(self) -> set[str]:
        if self.kept_base is None:
            return set()
        try:
            return set((self.kept_base / "kept" / RESTORED).read_text().split())
        except OSError:
            return set()

    def __call__(self, parts) -> list[Outcome]:
        """Restore the rows of these newly found broken parts (``store_health.BrokenPart``), a line per table said."""
        outcomes = []
        by_table: dict[str, list] = {}
        for part in parts:
            if f"{part.table}/{part.name}" not in self._done:
                by_table.setdefault(part.table, []).append(part)
        for table, broken in sorted(by_table.items()):
            try:
                outcome = self._restore(table, broken)
            except Exception as exc:  # the store refused: the part stays reported, and the next start tries again
                logger.error("store: table %s: cannot restore the rows of part %s now: %s", table,
                             ", ".join(p.name for p in broken), str(exc).strip().splitlines()[0])  # fmt: skip
                continue
            # remembered whatever came of it: block numbers above the active parts' are reused by later inserts,
            # so whether a part is covered is only known when it is first found (at start, before any insert)
            self._remember([f"{table}/{p.name}" for p in broken])
            if outcome is None:
                continue
            logger.log(logging.WARNING if outcome.parts and outcome.restored != outcome.rows else logging.INFO,
                       "%s", outcome.line())  # fmt: skip
            outcomes.append(outcome)
        return outcomes

    def _remember(self, names: list[str]) -> None:
        self._done.update(names)
        if self.kept_base is None:
            return
        try:
            (self.kept_base / "kept").mkdir(parents=True, exist_ok=True, mode=0o700)
            with (self.kept_base / "kept" / RESTORED).open("a") as out:
                out.write("".join(f"{name}\n" for name in names))
        except OSError:
            pass  # restored again at the next start: the key check stores nothing twice

    def _covered(self, table: str, broken) -> set[str]:
        db = {"db": self.store.database, "table": table}
        active: dict[str, list[tuple[int, int]]] = {}
        for partition, low, high in self.store.client.query(_ACTIVE_BLOCKS_SQL, parameters=db).result_rows:
            active.setdefault(partition, []).append((low, high))
        blocks = {name: (partition, low, high) for name, partition, low, high
                  in self.store.client.query(_DETACHED_BLOCKS_SQL, parameters=db).result_rows}  # fmt: skip
        covered = set()
        for part in broken:
            if part.name not in blocks:
                continue
            partition, low, high = blocks[part.name]
            need = low
            for a, b in sorted(active.get(partition, [])):
                if a <= need <= b:
                    need = b + 1
            if need > high:
                covered.add(part.name)
        return covered

    def _put_back(self, table: str, rows: list, columns) -> None:
        """Insert ``rows`` into ``table`` without firing its materialized views: their own tables (requests, stages,
        trace extents) kept their parts, so the rows they derived are there already. The rows go into a scratch
        table of the same layout, whose partitions are then attached to ``table`` (a part copy, which fires no view)."""
        from stagetrace.exporters.durable import insert_rows

        names = {"db": self.store.database, "table": table, "scratch": f"{SCRATCH_PREFIX}{table}"}
        primary, sorting, partition = self.store.client.query(_LAYOUT_SQL, parameters=names).result_rows[0]
        self.store.client.command(_DROP_SCRATCH_SQL, parameters=names)  # left by a restore a crash cut short
        self.store.client.command(_SCRATCH_SQL.format(**names, partition=partition, primary=primary, sorting=sorting,
                                                      durable=DURABLE_SETTINGS))  # its parts become the table's
        try:
            for start in range(0, len(rows), CHECK_ROWS):
                insert_rows(self.store, names["scratch"], rows[start : start + CHECK_ROWS], columns)
            for (partition_id,) in self.store.client.query(_SCRATCH_PARTITIONS_SQL, parameters=names).result_rows:
                self.store.client.command(_ATTACH_SQL.format(**names), parameters={"partition": partition_id})
        finally:
            self.store.client.command(_DROP_SCRATCH_SQL, parameters=names)

    def _restore(self, table: str, broken) -> Outcome | None:
        from stagetrace.exporters import spool
        from stagetrace.exporters.durable import record_tables

        covered = self._covered(table, broken)
        lost = [p for p in broken if p.name not in covered]
        names = _names(lost)
        if not lost:
            return Outcome(table, [], 0, 0, _names(broken), None)
        if table not in KEYS:
            logger.warning("store: table %s: the rows of part %s are not restored: only %s are (by their keys)", table,
                           ", ".join(names), ", ".join(KEYS))  # fmt: skip
            return None
        rows_held = None if any(p.rows is None for p in lost) else sum(p.rows for p in lost)
        ranges = [(p.first, p.last) for p in lost]
        bounded = all(first is not None and last is not None for first, last in ranges)
        ranges_ns = [(_ns(first), _ns(last)) for first, last in ranges] if bounded else []
        kept = spool.kept_records(self.kept_base) if self.kept_base is not None else []
        kept = [segment for segment in kept if segment.table == SOURCES[table]]
        since = None
        candidates, columns = [], None
        time_column = KEYS[table][0]
        for segment in kept:
            try:
                decoded = record_tables(segment.table)(segment.path.read_bytes())
            except Exception:  # a kept record that no longer reads restores nothing: the count below says so
                continue
            if table not in decoded:
                continue
            columns, rows = decoded[table]
            at = list(columns).index(time_column)
            for row in rows:
                t = _ns(row[at])
                if since is None or t < since:
                    since = t
                if not bounded or any(first <= t <= last for first, last in ranges_ns):
                    candidates.append(row)
        restored = 0
        if candidates:
            fresh = missing(self.store, table, columns, candidates)
            self._put_back(table, fresh, columns)
            restored = len(fresh)
        kept_since = datetime.fromtimestamp(since / 1e9, timezone.utc) if since is not None else None
        return Outcome(table, names, rows_held, restored, _names(p for p in broken if p.name in covered), kept_since)


__all__ = ["KEYS", "Outcome", "Restorer", "missing"]
