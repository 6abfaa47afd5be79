"""OpenTelemetry span exporter into ClickHouse's ``otel_traces``, with the Collector's column layout, and the
agent's metric writer into ``otel_metrics_gauge`` / ``otel_metrics_sum``::

    provider.add_span_processor(BatchSpanProcessor(ClickHouseSpanExporter(store="chdb:///var/lib/st")))

Both write through the one durable write path (``exporters.durable``). ``export`` returns ``SUCCESS`` only
once the spans are in the store or fsynced into the spool, from which they reach the store exactly once,
also through a kill and a restart (the next writer of the store replays what a dead one spooled); it
returns ``FAILURE`` when they are in neither (no spool, or the disk refused them) and after ``shutdown``.
Rows the store refuses for their values are dropped one by one and counted; the rest of their batch is
stored. One insert costs about the same up to a few thousand rows, so give the ``BatchSpanProcessor``
large batches (``stagetrace.configure`` uses 4,096). ``force_flush`` returns True when nothing waits in the
spool; ``shutdown`` tries the spool once more and closes the store if the exporter opened it.

Settings are arguments with environment fallbacks: ``STAGETRACE_STORE``, ``STAGETRACE_SPOOL_DIR`` and
``STAGETRACE_SPOOL_MAX_BYTES`` (see ``exporters.spool``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stagetrace import __version__
from stagetrace.metrics import COUNTER, INFO, Samples
from stagetrace.exporters import spool
from stagetrace.exporters.durable import DurableWriter
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


_TEXT = {str}


def attribute_map(attributes) -> dict[str, str]:
    if not attributes:
        return {}
    # the usual case, every value text, in C: the map itself (the SDK's is read-only once the span ended)
    if _TEXT.issuperset(map(type, attributes.values())):
        return attributes if type(attributes) is dict else dict(attributes)
    return {k: v if type(v) is str else attribute_text(v) for k, v in attributes.items()}


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


def _sdk_fields_are_known() -> bool:
    """Whether this SDK's ReadableSpan keeps the private fields the fast path reads (checked once, at import)."""
    try:
        fields = vars(ReadableSpan(name="probe"))
    except Exception:
        return False
    return {"_context", "_parent", "_resource", "_instrumentation_scope", "_start_time", "_end_time", "_status",
            "_name", "_kind", "_attributes", "_events", "_links"} <= fields.keys()  # fmt: skip


_SDK_FAST_PATH = _sdk_fields_are_known()


def span_row(span: ReadableSpan, resources: _Resources) -> tuple:
    """One ``otel_traces`` row, in ``COLUMNS`` order.

    The SDK's own spans are read through their private fields, where their public views copy (events,
    links), wrap (attributes) or cost a property call each: 4.9 -> 2.9 µs a span, measured. Any other
    ReadableSpan is read through the public API.
    """
    if _SDK_FAST_PATH and isinstance(span, ReadableSpan):
        ctx, parent, resource, scope = span._context, span._parent, span._resource, span._instrumentation_scope
        start, end, status, name, kind = span._start_time, span._end_time, span._status, span._name, span._kind
        status_code, description = status._status_code, status._description
        attributes = getattr(span._attributes, "_dict", span._attributes)  # BoundedAttributes' own dict
        events = getattr(span._events, "_dq", span._events)  # BoundedList's deque (a tuple: sequence as is)
        links = getattr(span._links, "_dq", span._links)
    else:
        ctx, parent, resource, scope = span.context, span.parent, span.resource, span.instrumentation_scope
        start, end, name, kind = span.start_time, span.end_time, span.name, span.kind
        status_code, description = span.status.status_code, span.status.description
        attributes, events, links = span.attributes, span.events, span.links
    service, resource_attrs = resources.get(resource)
    # the SDK takes any number for the times and does not check; the columns need integer nanoseconds
    start = int(start or 0)
    trace_state = ctx.trace_state
    row = (
        start,
        ctx.trace_id.to_bytes(16, "big").hex(),
        ctx.span_id.to_bytes(8, "big").hex(),
        parent.span_id.to_bytes(8, "big").hex() if parent is not None else "",
        trace_state.to_header() if trace_state is not None and getattr(trace_state, "_dict", trace_state) else "",
        name,
        _KIND[kind._value_],  # the enum's own field: its .value is a property, 10x slower
        service,
        resource_attrs,
        scope.name if scope is not None else "",
        (scope.version or "") if scope is not None else "",
        attribute_map(attributes),
        max(0, int(end or start) - start),
        _STATUS[status_code._value_],
        description or "",
    )
    if not events and not links:
        return row + _NO_EVENTS_OR_LINKS
    return row + (_event_columns(events) if events else _NO_EVENTS) + (_link_columns(links) if links else _NO_LINKS)


# Most spans have no events or links: shared empty tuples, not seven new lists a span, keep the
# garbage collector (which tracks every list) out of the export path (span_row 23 -> 5.5 µs measured).
_NO_EVENTS = ((), (), ())
_NO_LINKS = ((), (), (), ())
_NO_EVENTS_OR_LINKS = _NO_EVENTS + _NO_LINKS


def _event_columns(events) -> tuple:
    return [int(e.timestamp) for e in events], [e.name for e in events], [attribute_map(e.attributes) for e in events]


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


class ClickHouseSpanExporter(SpanExporter):
    """Span exporter into ``otel_traces`` (see the module docstring for the contract)."""

    def __init__(
        self,
        store: str | Location | Store | None = None,
        *,
        create_schema: bool = True,
        spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None,
    ):
        self._store, self._owns_store = _store_arg(store, create_schema)
        self._resources = _Resources()
        self._writer = DurableWriter(self._store, "spans", spool_dir=spool_dir, spool_max_bytes=spool_max_bytes)
        self._shutdown = False
        self._refused = 0  # spans answered FAILURE: neither stored nor spooled

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._writer.spool

    @property
    def dropped_spans(self) -> int:
        """Spans dropped: refused by the store for their values, or that the spool had no room for."""
        return self._writer.dropped_rows

    @property
    def refused_spans(self) -> int:
        """Spans answered ``FAILURE`` (the SDK counts them as dropped)."""
        return self._refused

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            logger.warning("ClickHouseSpanExporter is shut down; not taking %d spans", len(spans))
            return SpanExportResult.FAILURE
        resources = self._resources
        rows = [span_row(span, resources) for span in spans]
        if self._writer.write("otel_traces", COLUMNS, rows):
            return SpanExportResult.SUCCESS
        self._refused += len(rows)
        logger.error("%d spans could not be stored in %s nor spooled: not taken", len(rows),
                     self._store.location.redacted())  # fmt: skip
        return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """True when every span taken is in the store (none waits in the spool)."""
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._writer.flush(timeout_millis / 1000)
        self._writer.close()
        if self._owns_store:
            self._store.close()


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


def metric_rows(collected, host: str, time_ns: int, start_ns: int | None = None) -> dict[str, list[tuple]]:
    """``{table: rows}`` for what a node collected, sampled at ``time_ns``: client_python metric families
    (``Node.collect()``) or, without building families first, a node's ``Samples`` (``Node.collect_samples()``).

    Counters become cumulative monotonic sums that started at ``start_ns`` (default ``time_ns``);
    gauges and info metrics (value 1) become gauges. MetricName is the sample name as exposed
    (``rdma_port_transmit_bytes_total``); every label but ``host`` is an attribute, and ``host``
    is the resource's ``host.name``.
    """
    resource = {"host.name": host, "service.name": AGENT_SERVICE}
    gauges: list[tuple] = []
    sums: list[tuple] = []
    start = start_ns or time_ns

    def add(counter: bool, name: str, help: str, unit: str, attributes: dict, value: float) -> None:
        row = (resource, AGENT_SERVICE, METRIC_SCOPE, __version__, name, help, unit, attributes)
        if counter:
            sums.append((*row, start, time_ns, value, _CUMULATIVE, True))
        else:  # an OTel gauge point has no start time
            gauges.append((*row, 0, time_ns, value))

    for item in collected:
        if isinstance(item, Samples):
            for spec, values, value in item.series():
                attributes = dict(zip(spec.labels, values))
                if spec.type == INFO:  # the info's own labels join the series' labels; its value is 1
                    add(False, spec.name, spec.help, "", {**attributes, **value}, 1.0)
                else:
                    add(spec.type == COUNTER, spec.name, spec.help, spec.unit, attributes, float(value))
            continue
        counter = item.type == "counter"
        for sample in item.samples:
            if counter and sample.name.endswith("_created"):
                continue
            attributes = {k: v for k, v in sample.labels.items() if k != "host"}
            add(counter, sample.name, item.documentation, item.unit or "", attributes, float(sample.value))
    return {GAUGE_TABLE: gauges, SUM_TABLE: sums}


class ClickHouseMetricWriter:
    """Writes samples into ``otel_metrics_gauge`` and ``otel_metrics_sum``, one insert per table per write, or,
    with ``insert_every_s``, per table at most that often (and whenever ``insert_rows`` rows are held): an insert
    costs the engine about the same for 1,000 rows as for 10,000, so an agent sampling every second inserts
    every ten. The first write inserts at once; ``close`` inserts what is held.

    Through the durable write path: rows the store does not take go to the spool, and later samples of that
    table behind them, replayed in order when it takes inserts again. Without a spool (in-memory store, or
    ``spool_dir=False``, or free space below the agent's reserve, ``headroom``) they are held in memory and go
    first on the next ``write``; beyond ``max_held_rows`` the oldest are dropped and counted. ``close`` writes
    what it can, then closes the store if the writer opened it.
    """

    def __init__(
        self, store: str | Location | Store | None = None, *, host: str, max_held_rows: int = 100_000,
        create_schema: bool = True, spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None, insert_every_s: float = 0.0, insert_rows: int = 10_000, headroom=None,
    ):  # fmt: skip
        self._store, self._owns_store = _store_arg(store, create_schema)
        self.insert_every_s = insert_every_s
        self.insert_rows = insert_rows
        self._inserted_at: float | None = None
        self._storing = True  # whether the last insert was taken
        self._writer = DurableWriter(self._store, "metrics", spool_dir=spool_dir, spool_max_bytes=spool_max_bytes,
                                     headroom=headroom)  # fmt: skip
        self.host = host
        self.max_held_rows = max_held_rows
        self._dropped = 0
        self._held: dict[str, list[tuple]] = {GAUGE_TABLE: [], SUM_TABLE: []}
        self._started_ns = time.time_ns()  # counters are cumulative from the writer's first sample

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._writer.spool

    @property
    def dropped_rows(self) -> int:
        return self._dropped + self._writer.dropped_rows

    @property
    def held_rows(self) -> int:
        """Rows not in the store yet: held in memory or in the spool."""
        return sum(map(len, self._held.values())) + self._writer.spooled_rows()

    def write(self, collected, time_ns: int | None = None) -> bool:
        """Add one sample of what a node collected (families or ``Samples``, as :func:`metric_rows` takes) and insert
        everything held when an insert is due. False while the store is failing: the last insert's outcome. Between
        inserts the samples are held in memory only (a ``kill -9`` loses at most ``insert_every_s`` of them)."""
        for table, rows in metric_rows(collected, self.host, time_ns or time.time_ns(), self._started_ns).items():
            self._held[table].extend(rows)
        now = time.monotonic()
        due = self._inserted_at is None or now - self._inserted_at >= self.insert_every_s
        if not due and max(map(len, self._held.values())) < self.insert_rows:
            return self._storing
        self._inserted_at = now
        self._storing = self.flush()
        return self._storing

    def flush(self) -> bool:
        """Insert everything held; False when rows still wait (in memory or in the spool)."""
        for table, rows in self._held.items():
            if rows and self._writer.write(table, SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS, rows):
                rows.clear()
            excess = len(rows) - self.max_held_rows
            if excess > 0:
                del rows[:excess]
                self._dropped += excess
                spool.DROPPED.add("metric_samples", excess, "buffer_full")
                logger.error("dropped the %d oldest metric samples held for %s, which keeps failing",
                             excess, self._store.location.redacted())  # fmt: skip
        return self._writer.flush() and not any(self._held.values())

    def close(self) -> bool:
        """Insert what is held and close the store if the writer opened it; False when samples were lost."""
        self.flush()
        lost = sum(map(len, self._held.values()))
        if lost:
            logger.error("closing: %d metric samples could not be written to %s", lost, self._store.location.redacted())
        self._writer.close()
        if self._owns_store:
            self._store.close()
        return not lost


__all__ = [
    "ClickHouseSpanExporter", "COLUMNS", "span_row", "attribute_map",
    "ClickHouseMetricWriter", "METRIC_COLUMNS", "SUM_COLUMNS", "metric_rows",
]  # fmt: skip
