"""OpenTelemetry span exporter into ClickHouse's ``otel_traces``, with the Collector's column layout.

One chdb or server insert costs about the same up to a few thousand rows, and many small inserts
pile up parts, so the exporter coalesces the SDK's batches (512 spans under ``BatchSpanProcessor``)
into large, infrequent inserts made by its own writer thread::

    provider.add_span_processor(BatchSpanProcessor(ClickHouseSpanExporter(store="chdb:///var/lib/st")))

Result contract: ``export`` returns ``SUCCESS`` once the spans are held by the exporter, which
inserts them within ``max_delay_s`` (or sooner, at ``max_batch_rows``), retrying with back-off
while the store is failing; it returns ``FAILURE`` when the spans were dropped: after
``shutdown``, or when ``max_buffered_rows`` are already waiting for a store that keeps failing.
A batch the store does not take goes to the durable spool (``exporters.spool``), and later batches
behind it, so memory stays bounded through an outage and nothing is lost to a crash once spooled;
the spool is replayed in order, exactly once, when the store takes inserts again, also by the next
process after a kill. ``force_flush`` returns True only when everything accepted so far is in the
store (or was dropped, and counted, from a full spool). ``shutdown`` flushes what is held, within its
timeout, spools what the store did not take, then closes the store if the exporter opened it.

Settings are arguments with environment fallbacks: ``STAGETRACE_STORE``,
``STAGETRACE_EXPORT_MAX_ROWS`` (10000), ``STAGETRACE_EXPORT_MAX_DELAY`` (seconds, 1.0),
``STAGETRACE_EXPORT_MAX_BUFFERED_ROWS`` (200000), ``STAGETRACE_SPOOL_DIR`` and
``STAGETRACE_SPOOL_MAX_BYTES`` (see ``exporters.spool``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util import BoundedList

from stagetrace import __version__
from stagetrace.exporters import spool
from stagetrace.store import Location, Store, open_store

logger = logging.getLogger(__name__)

COLUMNS = (
    "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
    "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
    "StatusMessage", "Events.Timestamp", "Events.Name", "Events.Attributes", "Links.TraceId", "Links.SpanId",
    "Links.TraceState", "Links.Attributes",
)  # fmt: skip

# The Collector writes pdata's String() of kind and status code; indexed by the enums' values.
_KIND = ("Internal", "Server", "Client", "Producer", "Consumer")
_STATUS = ("Unset", "Ok", "Error")

_MAX_BACKOFF_S = 30.0


def attribute_text(value) -> str:
    """An attribute value as the Collector stores it in a ``Map(String, String)``."""
    if isinstance(value, str):
        return value
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, Sequence):
        # compact JSON, as the Collector's pcommon Slice.AsString writes arrays
        items = [v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for v in value]
        return json.dumps(items, separators=(",", ":"))
    return str(value)


def attribute_map(attributes) -> dict[str, str]:
    if not attributes:
        return {}
    return {k: v if type(v) is str else attribute_text(v) for k, v in attributes.items()}


# ReadableSpan's public views copy (events, links) or iterate through collections.abc (attributes),
# several µs a span; read the SDK's own containers when it has them, the public views otherwise.
def _span_attributes(span):
    raw = getattr(getattr(span, "_attributes", None), "_dict", None)
    return raw if isinstance(raw, dict) else span.attributes


def _span_sequence(span, private: str, public: str):
    raw = getattr(span, private, None)
    return raw if isinstance(raw, (tuple, BoundedList)) else getattr(span, public)


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        logger.warning("ignoring %s=%r: not a number; using %s", name, raw, default)
        return default


class _Resources:
    """Resource → (service name, attribute map), computed once per resource object."""

    def __init__(self):
        self._cache: dict[int, tuple] = {}

    def get(self, resource) -> tuple[str, dict[str, str]]:
        hit = self._cache.get(id(resource))
        if hit is not None and hit[0] is resource:
            return hit[1], hit[2]
        attrs = attribute_map(resource.attributes) if resource is not None else {}
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[id(resource)] = (resource, attrs.get("service.name", ""), attrs)
        return attrs.get("service.name", ""), attrs


def span_row(span: ReadableSpan, resources: _Resources) -> tuple:
    """One ``otel_traces`` row, in ``COLUMNS`` order."""
    ctx = span.context
    parent = span.parent
    service, resource_attrs = resources.get(span.resource)
    scope = span.instrumentation_scope
    start = span.start_time or 0
    status = span.status
    events = _span_sequence(span, "_events", "events")
    links = _span_sequence(span, "_links", "links")
    trace_state = ctx.trace_state
    return (
        start,
        f"{ctx.trace_id:032x}",
        f"{ctx.span_id:016x}",
        f"{parent.span_id:016x}" if parent is not None else "",
        trace_state.to_header() if trace_state else "",
        span.name,
        _KIND[span.kind.value],
        service,
        resource_attrs,
        scope.name if scope is not None else "",
        (scope.version or "") if scope is not None else "",
        attribute_map(_span_attributes(span)),
        max(0, (span.end_time or start) - start),
        _STATUS[status.status_code.value],
        status.description or "",
        *(_event_columns(events) if events else _NO_EVENTS),
        *(_link_columns(links) if links else _NO_LINKS),
    )


# Most spans have no events or links: shared empty tuples, not seven new lists a span, keep the
# garbage collector (which tracks every list) out of the export path (span_row 23 -> 5.5 µs measured).
_NO_EVENTS = ((), (), ())
_NO_LINKS = ((), (), (), ())


def _event_columns(events) -> tuple:
    return [e.timestamp for e in events], [e.name for e in events], [attribute_map(e.attributes) for e in events]


def _link_columns(links) -> tuple:
    return (
        [f"{link.context.trace_id:032x}" for link in links],
        [f"{link.context.span_id:016x}" for link in links],
        [link.context.trace_state.to_header() if link.context.trace_state else "" for link in links],
        [attribute_map(link.attributes) for link in links],
    )


def _store_arg(store: str | Location | Store | None, create_schema: bool) -> tuple[Store, bool]:
    """The store to write to and whether the writer opened it (and so closes it)."""
    if isinstance(store, Store):
        if create_schema:
            store.ensure_schema()
        return store, False
    return open_store(store, create_schema=create_schema), True


def _scrubbed(value):
    """``value`` with lone surrogates (a Python str may hold them, UTF-8 cannot) replaced, in rows of any shape."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_scrubbed(k): _scrubbed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrubbed(v) for v in value]
    return value


class _Inserts:
    """Inserts into one store that log one line when they start failing and one when they work again.

    Every insert carries an ``insert_deduplication_token`` (the batch's own when it may be a repeat, from
    the spool, else a fresh one): the store drops a block it has already taken under the same token, and
    never drops distinct batches that merely hold equal rows.
    """

    def __init__(self, store: Store, what: str):
        self.store = store
        self.what = what  # what the rows are, for the log lines
        self.failing_since: float | None = None

    def __call__(self, table: str, rows: list[tuple], columns: tuple[str, ...], token: str | None = None) -> bool:
        settings = {"insert_deduplication_token": token or spool.new_token()}
        try:
            try:
                self.store.client.insert(table, rows, column_names=columns, database=self.store.database,
                                         settings=settings)  # fmt: skip
            except UnicodeEncodeError:
                # Checking every string on the hot path costs more than this rare retry; a batch that can
                # never be encoded would otherwise block everything queued behind it.
                rows = _scrubbed(rows)
                self.store.client.insert(table, rows, column_names=columns, database=self.store.database,
                                         settings=settings)  # fmt: skip
        except Exception as exc:  # any driver or server error: the caller keeps the rows and retries
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if self.store.location.password:  # a driver's message may quote the URL it used
                    reason = reason.replace(self.store.location.password, "***")
                logger.error(
                    "cannot insert %d %s into %s, will retry: %s", len(rows), self.what, self.store.location.redacted(), reason
                )
            return False
        if self.failing_since is not None:
            logger.warning(
                "inserts into %s work again after %.1f s", self.store.location.redacted(),
                time.monotonic() - self.failing_since,
            )  # fmt: skip
            self.failing_since = None
        return True


class ClickHouseSpanExporter(SpanExporter):
    """Coalescing span exporter into ``otel_traces`` (see the module docstring for the contract)."""

    def __init__(
        self,
        store: str | Location | Store | None = None,
        *,
        max_batch_rows: int | None = None,
        max_delay_s: float | None = None,
        max_buffered_rows: int | None = None,
        create_schema: bool = True,
        spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None,
    ):
        self.max_batch_rows = int(max_batch_rows or _env_number("STAGETRACE_EXPORT_MAX_ROWS", 10_000))
        self.max_delay_s = float(max_delay_s if max_delay_s is not None else _env_number("STAGETRACE_EXPORT_MAX_DELAY", 1.0))
        self.max_buffered_rows = int(max_buffered_rows or _env_number("STAGETRACE_EXPORT_MAX_BUFFERED_ROWS", 200_000))
        self._store, self._owns_store = _store_arg(store, create_schema)
        self._inserts = _Inserts(self._store, "spans")
        self._resources = _Resources()
        self._pending: list[tuple] = []
        self._oldest = 0.0  # monotonic time the oldest pending row arrived
        # rows ever accepted / inserted / out of memory (inserted or spooled) / spooled by us, then dropped:
        # force_flush is done when _written + _lost reaches _accepted, shutdown when _durable does
        self._accepted = self._written = self._durable = self._lost = 0
        self._dropped = 0  # refused by export() while the buffer was full
        self._cond = threading.Condition()
        self._flush_wanted = False
        self._shutdown = False
        self._retry_at = 0.0  # monotonic time of the next attempt while the store is failing
        self._writer: threading.Thread | None = None
        self._spool = _spool_arg(spool_dir, spool_max_bytes, self._store, "spans")
        self._mine: dict = {}  # segments this exporter spooled -> rows, so their replay counts as written
        if self._spool is not None:
            self._spool.on_drop = self._spooled_rows_lost
            if len(self._spool):
                with self._cond:  # what an earlier process left: replay it now, not at the first export
                    self._start_writer()

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._spool

    @property
    def dropped_spans(self) -> int:
        """Spans lost: refused while the buffer was full, or dropped from a full spool."""
        return self._dropped + (self._spool.dropped_rows if self._spool is not None else 0)

    @property
    def held_rows(self) -> int:
        """Rows accepted and still in memory (neither in the store nor in the spool)."""
        return self._accepted - self._durable

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            logger.warning("ClickHouseSpanExporter is shut down; dropping %d spans", len(spans))
            return SpanExportResult.FAILURE
        resources = self._resources
        rows = [span_row(span, resources) for span in spans]
        with self._cond:
            if len(self._pending) + len(rows) > self.max_buffered_rows:
                self._dropped += len(rows)
                spool.DROPPED.add("spans", len(rows))
                logger.error(
                    "dropping %d spans: %d are already waiting for %s, which keeps failing",
                    len(rows), len(self._pending), self._store.location.redacted(),
                )  # fmt: skip
                return SpanExportResult.FAILURE
            was_idle = not self._pending
            if was_idle:
                self._oldest = time.monotonic()
            self._pending.extend(rows)
            self._accepted += len(rows)
            self._start_writer()
            # an idle writer waits without a deadline: wake it to start the max_delay_s clock, or to write a full batch
            if was_idle or len(self._pending) >= self.max_batch_rows:
                self._cond.notify_all()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._wait(lambda: self._written + self._lost, timeout_millis)

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        if self._shutdown:
            return
        deadline = time.monotonic() + timeout_millis / 1000
        # with a spool, what is on disk is safe: do not wait out a store outage
        self._wait(lambda: self._durable if self._spool is not None else self._written, timeout_millis)
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=max(0.1, deadline - time.monotonic()))
        with self._cond:
            leftover, self._pending = self._pending, []
        if leftover and self._spool is not None:
            if self._spool.put("otel_traces", COLUMNS, leftover, spool.new_token()):  # else dropped and counted there
                logger.warning("shutdown: %d spans spooled in %s for the next run", len(leftover), self._spool.directory)
        elif leftover:
            self._dropped += len(leftover)
            spool.DROPPED.add("spans", len(leftover))
            logger.error("shutdown: %d spans could not be written to %s", len(leftover),
                         self._store.location.redacted())  # fmt: skip
        if self._spool is not None and len(self._spool):
            logger.warning("shutdown: %d spans wait in the spool %s for the next run", self._spool.rows(),
                           self._spool.directory)  # fmt: skip
        if self._spool is not None:
            self._spool.close()
        if self._owns_store:
            self._store.close()

    def _wait(self, done, timeout_millis: int) -> bool:
        """Ask the writer to write what is pending now and wait until ``done()`` reaches what was accepted."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            target = self._accepted
            if done() >= target:
                return True
            self._flush_wanted = True
            self._retry_at = 0.0  # one attempt now rather than at the end of the back-off
            self._cond.notify_all()
            while done() < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._writer is None or not self._writer.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def _start_writer(self) -> None:  # called with self._cond held
        if self._writer is None:
            self._writer = threading.Thread(target=self._run, name="stagetrace-clickhouse-writer", daemon=True)
            self._writer.start()

    def _spooled_rows_lost(self, segment) -> None:
        with self._cond:
            self._lost += self._mine.pop(segment.path, 0)
            self._cond.notify_all()

    def _due(self) -> bool:
        if not self._pending or (self._spool is None and time.monotonic() < self._retry_at):
            return False
        return (
            self._flush_wanted
            or len(self._pending) >= self.max_batch_rows
            or time.monotonic() - self._oldest >= self.max_delay_s
        )

    def _replay_due(self) -> bool:
        return self._spool is not None and len(self._spool) > 0 and time.monotonic() >= self._retry_at

    def _next_wakeup(self) -> float | None:
        """Seconds until the writer has something to do, None when only an export or a flush can give it work."""
        times = []
        if self._pending:  # without a spool, a failed batch waits in _pending for the back-off
            due = self._oldest + self.max_delay_s
            times.append(due if self._spool is not None else max(due, self._retry_at))
        if self._spool is not None and len(self._spool):
            times.append(self._retry_at)
        return min(times) - time.monotonic() if times else None

    def _run(self) -> None:
        """The writer: inserts due batches; while the store fails, spools them and replays the spool in order."""
        backoff = 0.0
        while True:
            with self._cond:
                while not self._shutdown and not self._due() and not self._replay_due():
                    wakeup = self._next_wakeup()
                    self._cond.wait(None if wakeup is None else max(0.01, wakeup))
                if self._shutdown:
                    return
                batch = self._pending[: self.max_batch_rows] if self._due() else []
                del self._pending[: len(batch)]
                if self._pending:
                    self._oldest = time.monotonic()
            worked = self._write(batch) if batch else None  # None: the store was not tried
            if worked is not False and self._replay_due():
                worked = self._replay_one()
            with self._cond:
                if worked:
                    backoff = self._retry_at = 0.0
                elif worked is False:
                    backoff = min(_MAX_BACKOFF_S, max(0.1, backoff * 2))
                    self._retry_at = time.monotonic() + backoff
                if self._written + self._lost >= self._accepted:
                    self._flush_wanted = False
                self._cond.notify_all()

    def _write(self, batch: list[tuple]) -> bool | None:
        """Insert ``batch`` (True), or spool it when the insert fails (False) or behind a backlog (None)."""
        token = spool.new_token()  # before the first attempt: a replay of a batch the store took adds nothing
        backlog = self._spool is not None and len(self._spool) > 0
        if not backlog and self._inserts("otel_traces", batch, COLUMNS, token):
            with self._cond:
                self._written += len(batch)
                self._durable += len(batch)
            return True
        if self._spool is None:
            with self._cond:
                self._pending[:0] = batch  # keep order: these go first on the next attempt
                self._oldest = time.monotonic()
            return False
        segment = self._spool.put("otel_traces", COLUMNS, batch, token)
        with self._cond:
            self._durable += len(batch)
            if segment is None:
                self._lost += len(batch)
            else:
                self._mine[segment.path] = len(batch)
        return None if backlog else False

    def _replay_one(self) -> bool:
        segment = self._spool.oldest()
        if segment is None:
            return True
        batch = self._spool.load(segment)
        if batch is None:  # unreadable: dropped and counted by the spool
            return True
        if not self._inserts(batch.table, batch.rows, batch.columns, batch.token):
            return False
        self._spool.remove(segment)
        with self._cond:
            self._written += self._mine.pop(segment.path, 0)
        return True


def _spool_arg(directory, max_bytes: int | None, store: Store, kind: str) -> spool.Spool | None:
    """The writer's spool: ``directory`` (False: none; None: ``STAGETRACE_SPOOL_DIR`` or beside the store)."""
    if directory is False or store.read_only:
        return None
    return spool.open_spool(store.location, kind, None if directory is True else directory, max_bytes)


# Hardware samples: the families of ``Node.collect()`` -> otel_metrics_gauge / otel_metrics_sum.

AGENT_SERVICE = "stagetrace-agent"
METRIC_SCOPE = "stagetrace.collectors"
GAUGE_TABLE, SUM_TABLE = "otel_metrics_gauge", "otel_metrics_sum"
METRIC_COLUMNS = (
    "ResourceAttributes", "ServiceName", "ScopeName", "ScopeVersion", "MetricName", "MetricDescription", "MetricUnit",
    "Attributes", "StartTimeUnix", "TimeUnix", "Value",
)  # fmt: skip
SUM_COLUMNS = (*METRIC_COLUMNS, "AggregationTemporality", "IsMonotonic")
_CUMULATIVE = 2  # OTel AggregationTemporality: 1 delta, 2 cumulative


def metric_rows(families, host: str, time_ns: int, start_ns: int | None = None) -> dict[str, list[tuple]]:
    """``{table: rows}`` for client_python metric families (``Node.collect()``), sampled at ``time_ns``.

    Counters become cumulative monotonic sums that started at ``start_ns`` (default ``time_ns``);
    gauges and info metrics (value 1) become gauges. MetricName is the sample name as exposed
    (``rdma_port_transmit_bytes_total``); every label but ``host`` is an attribute, and ``host``
    is the resource's ``host.name``.
    """
    resource = {"host.name": host, "service.name": AGENT_SERVICE}
    gauges: list[tuple] = []
    sums: list[tuple] = []
    for family in families:
        counter = family.type == "counter"
        for sample in family.samples:
            if counter and sample.name.endswith("_created"):
                continue
            row = (
                resource, AGENT_SERVICE, METRIC_SCOPE, __version__, sample.name, family.documentation, family.unit or "",
                {k: v for k, v in sample.labels.items() if k != "host"},
            )  # fmt: skip
            if counter:
                sums.append((*row, start_ns or time_ns, time_ns, float(sample.value), _CUMULATIVE, True))
            else:  # an OTel gauge point has no start time
                gauges.append((*row, 0, time_ns, float(sample.value)))
    return {GAUGE_TABLE: gauges, SUM_TABLE: sums}


class ClickHouseMetricWriter:
    """Writes samples into ``otel_metrics_gauge`` and ``otel_metrics_sum``, one insert per table per write.

    Rows an insert could not take go to the spool (``exporters.spool``), and later samples of that table
    behind them, until the store takes inserts again: then they are replayed in order, each batch under
    its deduplication token. Without a spool (in-memory store, or ``spool_dir=False``) they are held in
    memory and go first on the next ``write``; beyond ``max_held_rows`` the oldest are dropped. One log
    line when the store starts failing, one when it works again. ``close`` writes what it can, then closes
    the store if the writer opened it.
    """

    def __init__(
        self, store: str | Location | Store | None = None, *, host: str, max_held_rows: int = 100_000,
        create_schema: bool = True, spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None,
    ):  # fmt: skip
        self._store, self._owns_store = _store_arg(store, create_schema)
        # per table, so a working gauge insert does not announce a failing sum insert as recovered
        self._inserts = {table: _Inserts(self._store, f"{table} rows") for table in (GAUGE_TABLE, SUM_TABLE)}
        self.host = host
        self.max_held_rows = max_held_rows
        self._dropped = 0
        self._held: dict[str, list[tuple]] = {GAUGE_TABLE: [], SUM_TABLE: []}
        self._started_ns = time.time_ns()  # counters are cumulative from the writer's first sample
        self._spool = _spool_arg(spool_dir, spool_max_bytes, self._store, "metrics")

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._spool

    @property
    def dropped_rows(self) -> int:
        return self._dropped + (self._spool.dropped_rows if self._spool is not None else 0)

    @property
    def held_rows(self) -> int:
        """Rows not in the store yet: held in memory or in the spool."""
        return sum(map(len, self._held.values())) + (self._spool.rows() if self._spool is not None else 0)

    def write(self, families, time_ns: int | None = None) -> bool:
        """Add one sample of ``families`` and insert everything held; False while the store is failing."""
        for table, rows in metric_rows(families, self.host, time_ns or time.time_ns(), self._started_ns).items():
            if not rows:
                continue
            if self._spool is not None:
                self._write_spooled(table, rows)
                continue
            held = self._held[table]
            held.extend(rows)
            excess = len(held) - self.max_held_rows
            if excess > 0:
                del held[:excess]
                self._dropped += excess
                spool.DROPPED.add("metric_samples", excess)
                logger.error("dropped the %d oldest metric samples held for %s, which keeps failing",
                             excess, self._store.location.redacted())  # fmt: skip
        return self.flush()

    def _write_spooled(self, table: str, rows: list[tuple]) -> None:
        token = spool.new_token()
        columns = SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS
        # behind a backlog of this table, in order; flush() replays it
        if self._spool.rows(table) or not self._inserts[table](table, rows, columns, token):
            self._spool.put(table, columns, rows, token)

    def flush(self) -> bool:
        """Insert everything held; False when a table's insert failed (its rows stay held or spooled)."""
        written = True
        for table, rows in self._held.items():
            if self._spool is not None:
                insert = self._inserts[table]
                replayed = self._spool.replay(lambda b, insert=insert: insert(b.table, b.rows, b.columns, b.token), table)
                written = replayed and written
                continue
            if rows and self._inserts[table](table, rows, SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS):
                rows.clear()
            written = written and not rows
        return written

    def close(self) -> bool:
        """Insert what is held and close the store if the writer opened it; False when samples were lost."""
        written = self.flush()
        lost = not written and self._spool is None
        if lost:
            logger.error("closing: %d metric samples could not be written to %s", self.held_rows,
                         self._store.location.redacted())  # fmt: skip
        elif not written:
            logger.warning("closing: %d metric samples wait in the spool %s for the next run", self.held_rows,
                           self._spool.directory)  # fmt: skip
        if self._spool is not None:
            self._spool.close()
        if self._owns_store:
            self._store.close()
        return not lost


__all__ = [
    "ClickHouseSpanExporter", "COLUMNS", "span_row", "attribute_map",
    "ClickHouseMetricWriter", "METRIC_COLUMNS", "SUM_COLUMNS", "metric_rows",
]  # fmt: skip
