"""Every row the exporters and receivers store, built in one place: the columns of the Collector's tables, and the
rows of SDK spans, of OTLP spans, metric points and log records, and of a node's samples. Writers insert
(``clickhouse``, ``otlp`` through ``durable``); this module only builds.

* Spans: ``span_row`` makes one ``otel_traces`` row (``COLUMNS``) of an SDK ``ReadableSpan`` or of what
  ``span_views`` makes of an OTLP ``ExportTraceServiceRequest``, so both get exactly the same columns.
  ``Resources`` keeps each resource's service name and attribute map, computed once per resource object.
* Metrics: ``node_metric_rows`` makes the agent's ``otel_metrics_gauge`` / ``otel_metrics_sum`` rows of a node's
  samples; ``otlp_metric_rows`` those of an OTLP request's gauge and sum points (``GAUGE_COLUMNS``,
  ``OTLP_SUM_COLUMNS``: the Collector's extra columns too).
* Logs: ``log_rows`` makes ``otel_logs`` rows (``LOG_COLUMNS``) of an OTLP request's log records.

The ``*_counts`` functions say, without building rows, how many of a request's items the rows take and how many
they leave out: the receivers answer with them before the rows are made.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from stagetrace import __version__, conventions
from stagetrace.metrics import COUNTER, INFO, Samples

if TYPE_CHECKING:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

# --- spans ------------------------------------------------------------------------------------------------

COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "TraceState",
    "SpanName",
    "SpanKind",
    "ServiceName",
    "ResourceAttributes",
    "ScopeName",
    "ScopeVersion",
    "SpanAttributes",
    "Duration",
    "StatusCode",
    "StatusMessage",
    "Events.Timestamp",
    "Events.Name",
    "Events.Attributes",
    "Links.TraceId",
    "Links.SpanId",
    "Links.TraceState",
    "Links.Attributes",
)

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


class Resources:
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
    return {
        "_context",
        "_parent",
        "_resource",
        "_instrumentation_scope",
        "_start_time",
        "_end_time",
        "_status",
        "_name",
        "_kind",
        "_attributes",
        "_events",
        "_links",
    } <= fields.keys()


_SDK_FAST_PATH = _sdk_fields_are_known()


def span_row(span: ReadableSpan, resources: Resources) -> tuple:
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


# --- OTLP spans -------------------------------------------------------------------------------------------


class _TraceState(str):
    """OTLP carries the W3C tracestate header text; span_row asks the SDK's TraceState for ``to_header()``."""

    def to_header(self) -> str:
        return str(self)


def _value(any_value):
    """An OTLP AnyValue as the Python value the SDK would hold; what the SDK cannot hold as the Collector writes it."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return ""
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    if kind == "kvlist_value":
        return json.dumps({kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}, separators=(",", ":"))
    if kind == "bytes_value":
        return base64.b64encode(any_value.bytes_value).decode()
    return getattr(any_value, kind)


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


def _context(trace_id: bytes, span_id: bytes, trace_state: str) -> SimpleNamespace:
    return SimpleNamespace(
        trace_id=int.from_bytes(trace_id, "big"),
        span_id=int.from_bytes(span_id, "big"),
        trace_state=_TraceState(trace_state),
    )


def _valid_ids(trace_id: bytes, span_id: bytes) -> bool:
    return len(trace_id) == 16 and len(span_id) == 8 and any(trace_id) and any(span_id)


# The spec lets a receiver read SPAN_KIND_UNSPECIFIED (0) as INTERNAL; OTLP kinds are the SDK's plus one.
_KINDS = {0: SpanKind.INTERNAL, **{kind.value + 1: kind for kind in SpanKind}}
_STATUS_CODES = {code.value: code for code in StatusCode}


def span_views(request: ExportTraceServiceRequest) -> tuple[list[SimpleNamespace], int]:
    """What ``span_row`` reads of each span, and how many spans were rejected for invalid IDs."""
    views, rejected = [], 0
    for resource_spans in request.resource_spans:
        # one object per resource: span_row caches the resource's attribute map by identity
        resource = SimpleNamespace(attributes=_attributes(resource_spans.resource.attributes))
        for scope_spans in resource_spans.scope_spans:
            scope = SimpleNamespace(name=scope_spans.scope.name, version=scope_spans.scope.version)
            for span in scope_spans.spans:
                parent = span.parent_span_id
                if not _valid_ids(span.trace_id, span.span_id) or len(parent) not in (0, 8):
                    rejected += 1
                    continue
                views.append(
                    SimpleNamespace(
                        name=span.name,
                        context=_context(span.trace_id, span.span_id, span.trace_state),
                        parent=SimpleNamespace(span_id=int.from_bytes(parent, "big")) if any(parent) else None,
                        resource=resource,
                        instrumentation_scope=scope,
                        start_time=span.start_time_unix_nano,
                        end_time=span.end_time_unix_nano,
                        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
                        status=SimpleNamespace(
                            status_code=_STATUS_CODES.get(span.status.code, StatusCode.UNSET),
                            description=span.status.message,
                        ),
                        attributes=_attributes(span.attributes),
                        events=[
                            SimpleNamespace(
                                timestamp=e.time_unix_nano, name=e.name, attributes=_attributes(e.attributes)
                            )
                            for e in span.events
                        ],
                        links=[
                            SimpleNamespace(
                                context=_context(link.trace_id, link.span_id, link.trace_state),
                                attributes=_attributes(link.attributes),
                            )
                            for link in span.links
                            if _valid_ids(link.trace_id, link.span_id)
                        ],
                    )
                )
    # ranks an engine records on an enclosing span (SGLang's thread span) reach the stage spans below it here, in the
    # one place every OTLP span passes with its neighbours of the same export (conventions.ENCLOSING_RANKS)
    conventions.inherit_ranks(views)
    return views, rejected


def span_counts(request: ExportTraceServiceRequest) -> tuple[int, int]:
    """How many spans ``span_views`` takes and how many it rejects, without making the views."""
    valid = rejected = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if _valid_ids(span.trace_id, span.span_id) and len(span.parent_span_id) in (0, 8):
                    valid += 1
                else:
                    rejected += 1
    return valid, rejected


# --- metrics ----------------------------------------------------------------------------------------------

# A node's samples: the families of ``Node.collect()`` -> otel_metrics_gauge / otel_metrics_sum.

AGENT_SERVICE = "stagetrace-agent"
METRIC_SCOPE = "stagetrace.collectors"
GAUGE_TABLE, SUM_TABLE = "otel_metrics_gauge", "otel_metrics_sum"
METRIC_COLUMNS = (
    "ResourceAttributes",
    "ServiceName",
    "ScopeName",
    "ScopeVersion",
    "MetricName",
    "MetricDescription",
    "MetricUnit",
    "Attributes",
    "StartTimeUnix",
    "TimeUnix",
    "Value",
)
SUM_COLUMNS = (*METRIC_COLUMNS, "AggregationTemporality", "IsMonotonic")
_CUMULATIVE = 2  # OTel AggregationTemporality: 1 delta, 2 cumulative


def node_metric_rows(collected, host: str, time_ns: int, start_ns: int | None = None) -> dict[str, list[tuple]]:
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


# Columns the Collector writes that client_python samples have no value for.
_METRIC_EXTRA = ("ResourceSchemaUrl", "ScopeAttributes", "ScopeDroppedAttrCount", "ScopeSchemaUrl", "Flags")
GAUGE_COLUMNS = (*METRIC_COLUMNS, *_METRIC_EXTRA)
OTLP_SUM_COLUMNS = (*SUM_COLUMNS, *_METRIC_EXTRA)


def metric_counts(request: ExportMetricsServiceRequest) -> tuple[int, int, str]:
    """How many points ``otlp_metric_rows`` stores, how many others were rejected, and why."""
    stored, rejected, kinds = 0, 0, set()
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                points = len(getattr(metric, kind).data_points) if kind else 0
                if kind in ("gauge", "sum"):
                    stored += points
                else:
                    rejected += points
                    kinds.add(kind or "empty")
    why = f"{', '.join(sorted(kinds))} points are not stored: stagetrace keeps gauges and sums" if rejected else ""
    return stored, rejected, why


def otlp_metric_rows(request: ExportMetricsServiceRequest) -> dict[str, list[tuple]]:
    """``{table: rows}`` for the gauge and sum points (the other kinds: see ``metric_counts``)."""
    tables: dict[str, list[tuple]] = {GAUGE_TABLE: [], SUM_TABLE: []}
    for resource_metrics in request.resource_metrics:
        resource = attribute_map(_attributes(resource_metrics.resource.attributes))
        service = resource.get("service.name", "")
        for scope_metrics in resource_metrics.scope_metrics:
            scope = scope_metrics.scope
            extra = (
                resource_metrics.schema_url,
                attribute_map(_attributes(scope.attributes)),
                scope.dropped_attributes_count,
                scope_metrics.schema_url,
            )
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind not in ("gauge", "sum"):
                    continue
                data = getattr(metric, kind)
                head = (resource, service, scope.name, scope.version, metric.name, metric.description, metric.unit)
                for point in data.data_points:
                    value = float(getattr(point, point.WhichOneof("value") or "as_double"))
                    row = (
                        *head,
                        attribute_map(_attributes(point.attributes)),
                        point.start_time_unix_nano,
                        point.time_unix_nano,
                        value,
                    )
                    if kind == "sum":
                        row = (*row, int(data.aggregation_temporality), data.is_monotonic)
                    tables[GAUGE_TABLE if kind == "gauge" else SUM_TABLE].append((*row, *extra, point.flags))
    return tables


# --- logs -------------------------------------------------------------------------------------------------

LOGS_TABLE = "otel_logs"
LOG_COLUMNS = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "TraceFlags",
    "SeverityText",
    "SeverityNumber",
    "ServiceName",
    "Body",
    "ResourceSchemaUrl",
    "ResourceAttributes",
    "ScopeSchemaUrl",
    "ScopeName",
    "ScopeVersion",
    "ScopeAttributes",
    "LogAttributes",
)


def _body(any_value) -> str:
    """A log record's body as the Collector stores it: a string as it is, anything else as JSON."""
    value = _value(any_value)
    if isinstance(value, str):
        return value
    return json.dumps(list(value) if isinstance(value, tuple) else value, separators=(",", ":"))


def log_rows(request: ExportLogsServiceRequest) -> list[tuple]:
    """One ``otel_logs`` row per log record, in the Collector's columns (``LOG_COLUMNS``): a record without a time
    takes the time it was observed; trace and span IDs as hex, empty when the record belongs to no span."""
    rows = []
    for resource_logs in request.resource_logs:
        resource = attribute_map(_attributes(resource_logs.resource.attributes))
        service = resource.get("service.name", "")
        for scope_logs in resource_logs.scope_logs:
            scope = scope_logs.scope
            scope_head = (
                scope_logs.schema_url,
                scope.name,
                scope.version,
                attribute_map(_attributes(scope.attributes)),
            )
            for record in scope_logs.log_records:
                rows.append(
                    (
                        record.time_unix_nano or record.observed_time_unix_nano,
                        record.trace_id.hex(),
                        record.span_id.hex(),
                        record.flags & 0xFF,
                        record.severity_text,
                        int(record.severity_number),
                        service,
                        _body(record.body),
                        resource_logs.schema_url,
                        resource,
                        *scope_head,
                        attribute_map(_attributes(record.attributes)),
                    )
                )
    return rows


def log_counts(request: ExportLogsServiceRequest) -> int:
    return sum(len(s.log_records) for r in request.resource_logs for s in r.scope_logs)


__all__ = [
    "AGENT_SERVICE",
    "COLUMNS",
    "GAUGE_COLUMNS",
    "GAUGE_TABLE",
    "LOG_COLUMNS",
    "LOGS_TABLE",
    "METRIC_COLUMNS",
    "METRIC_SCOPE",
    "OTLP_SUM_COLUMNS",
    "Resources",
    "SUM_COLUMNS",
    "SUM_TABLE",
    "attribute_map",
    "attribute_text",
    "log_counts",
    "log_rows",
    "metric_counts",
    "node_metric_rows",
    "otlp_metric_rows",
    "span_counts",
    "span_row",
    "span_views",
]
