"""OTLP/HTTP receiver: ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` into the tables the Python exporters
and the Collector write; its core (``OtlpReceiver.traces``/``metrics``/``logs``) also serves the OTLP/gRPC receiver
(``otlp_grpc``). Log records go to the Collector's ``otel_logs``, bodies as the producer sent them, joined to the
request's trace by ``TraceId``/``SpanId``.

Whatever speaks OTLP/HTTP can send to ``stagetrace agent --otlp 127.0.0.1:4318``: an OpenTelemetry SDK's
``OTLPSpanExporter``, vLLM (``--otlp-traces-endpoint`` with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``),
SGLang, a Collector's ``otlphttp`` exporter. Binary protobuf (``application/x-protobuf``) and OTLP/JSON
(``application/json``: hex trace and span IDs, lowerCamelCase keys, enums as integers) are decoded with the
official ``opentelemetry-proto`` messages; ``Content-Encoding: gzip`` or ``deflate`` bodies are inflated
within the size limit.

Each OTLP span is read through a view that ``span_row`` takes like an SDK span, so it gets exactly the
columns the in-process ``ClickHouseSpanExporter`` writes. Gauge and sum points go to
``otel_metrics_gauge``/``otel_metrics_sum`` in the Collector's layout. A request is answered only once it is
durable: written ahead as it arrived and fsynced into the spool (``exporters.durable``), whose replay thread
stores the rows of many requests in one insert; without a spool, once its rows are inserted. Each request has
a token derived from its body, so a sender that retries a request whose answer it never got (the agent was
killed in between) does not store it twice. Answers, as the OTLP/HTTP specification has them:

* 200, with ``partial_success`` counting the spans or points that were not taken (invalid IDs, histograms);
  the sender must not retry those.
* 400 a body that does not decode · 401 no or wrong token · 404/405 other paths or methods ·
  411 no Content-Length · 413 body over the limit, compressed or inflated, or more spans than one request may
  hold · 415 another content type.
* 503 with ``Retry-After`` when the request cannot be kept now: the spool is full (the store has refused
  inserts for long) or its disk refuses writes, free space under the store or the spool is below the agent's
  reserve (``--min-free-space``, see ``exporters.diskspace``), or there is no spool and the store refuses
  inserts. The sender retries later; a full spool refuses new requests rather than dropping acknowledged ones.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.trace import SpanKind, StatusCode

from stagetrace import conventions, httpd
from stagetrace.exporters.clickhouse import (
    COLUMNS,
    GAUGE_TABLE,
    METRIC_COLUMNS,
    SUM_COLUMNS,
    SUM_TABLE,
    _Resources,
    attribute_map,
    span_row,
)
from stagetrace.exporters.durable import DurableWriter, NoRoom
from stagetrace.exporters.records import RecordKind, register
from stagetrace.exporters.spool import new_token
from stagetrace.store import Store

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:4318"
MAX_BODY_BYTES = 20 * 1024 * 1024  # the Collector's otlp receiver default (confighttp max_request_body_size)
MAX_SPANS = 50_000  # in one request
MAX_IN_FLIGHT = 8  # HTTP requests served at once (bodies in memory: at most 8 x MAX_BODY_BYTES); beyond, 503
RETRY_AFTER_S = 2
CLOSE_FLUSH_S = 10.0  # on close, how long the receiver goes on storing what it wrote ahead
PROTOBUF, JSON = "application/x-protobuf", "application/json"

# Columns the Collector writes that client_python samples have no value for.
_METRIC_EXTRA = ("ResourceSchemaUrl", "ScopeAttributes", "ScopeDroppedAttrCount", "ScopeSchemaUrl", "Flags")
GAUGE_COLUMNS = (*METRIC_COLUMNS, *_METRIC_EXTRA)
OTLP_SUM_COLUMNS = (*SUM_COLUMNS, *_METRIC_EXTRA)


class OtlpError(httpd.HttpError):
    """A request the receiver answers with an HTTP error; ``message`` goes back in a google.rpc.Status."""

    def __init__(self, status: int, message: str, *, retry: bool = False, body_read: bool = True):
        super().__init__(status, message, body_read=body_read)
        self.retry = retry  # answer with Retry-After: the sender tries again later


def _status_class():
    """``google.rpc.Status`` (code, message, details), the body of OTLP/HTTP error answers and OTLP/gRPC's rich
    status, built in a private pool: opentelemetry-proto does not ship it, and a sender's googleapis-common-protos
    may hold the same name."""
    field = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="stagetrace/rpc_status.proto", package="google.rpc", syntax="proto3",
                                             dependency=[any_pb2.DESCRIPTOR.name])  # fmt: skip
    message = fdp.message_type.add(name="Status")
    message.field.add(name="code", number=1, type=field.TYPE_INT32, json_name="code")
    message.field.add(name="message", number=2, type=field.TYPE_STRING, json_name="message")
    message.field.add(name="details", number=3, type=field.TYPE_MESSAGE, label=field.LABEL_REPEATED,
                      type_name=".google.protobuf.Any", json_name="details")  # fmt: skip
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(any_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("google.rpc.Status"))


_RpcStatus = _status_class()
# google.rpc.Code for each HTTP status the receiver sends
_RPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 503: 14}


# --- bodies -----------------------------------------------------------------------------------------------


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


# OTLP/JSON writes these bytes fields as hex, while protobuf's JSON mapping expects base64.
_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})
_BAD_ID = base64.b64encode(b"\xff").decode()  # decodes, then fails the length check: that span alone is rejected


def _hex_ids_to_base64(node) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                try:
                    node[key] = base64.b64encode(bytes.fromhex(value)).decode()
                except ValueError:
                    node[key] = _BAD_ID
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)


def decode(message, body: bytes, media: str):
    """Fill ``message`` from an OTLP body in ``media`` encoding; OtlpError(400) when it does not decode."""
    try:
        if media == PROTOBUF:
            message.ParseFromString(body)
        else:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("the body is not a JSON object")
            _hex_ids_to_base64(data)
            json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except (DecodeError, ValueError, json_format.ParseError, RecursionError) as exc:
        what = "protobuf" if media == PROTOBUF else "OTLP/JSON"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OtlpError(400, f"body is not a valid {type(message).__name__} in {what}: {reason}") from None
    return message


def encode(message, media: str) -> bytes:
    if media == JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


# --- spans ------------------------------------------------------------------------------------------------


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
    return SimpleNamespace(trace_id=int.from_bytes(trace_id, "big"), span_id=int.from_bytes(span_id, "big"),
                           trace_state=_TraceState(trace_state))  # fmt: skip


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
                views.append(SimpleNamespace(
                    name=span.name,
                    context=_context(span.trace_id, span.span_id, span.trace_state),
                    parent=SimpleNamespace(span_id=int.from_bytes(parent, "big")) if any(parent) else None,
                    resource=resource,
                    instrumentation_scope=scope,
                    start_time=span.start_time_unix_nano,
                    end_time=span.end_time_unix_nano,
                    kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
                    status=SimpleNamespace(status_code=_STATUS_CODES.get(span.status.code, StatusCode.UNSET),
                                           description=span.status.message),
                    attributes=_attributes(span.attributes),
                    events=[SimpleNamespace(timestamp=e.time_unix_nano, name=e.name, attributes=_attributes(e.attributes))
                            for e in span.events],
                    links=[SimpleNamespace(context=_context(link.trace_id, link.span_id, link.trace_state),
                                           attributes=_attributes(link.attributes))
                           for link in span.links if _valid_ids(link.trace_id, link.span_id)],
                ))  # fmt: skip
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


def trace_tables(payload: bytes) -> dict[str, tuple]:
    """A write-ahead record of an ``ExportTraceServiceRequest`` as rows (``records``)."""
    views, _ = span_views(ExportTraceServiceRequest.FromString(payload))
    resources = _Resources()
    return {"otel_traces": (COLUMNS, [span_row(view, resources) for view in views])}


def metric_tables(payload: bytes) -> dict[str, tuple]:
    """A write-ahead record of an ``ExportMetricsServiceRequest`` as rows (``records``)."""
    tables = metric_rows(ExportMetricsServiceRequest.FromString(payload))
    return {GAUGE_TABLE: (GAUGE_COLUMNS, tables[GAUGE_TABLE]), SUM_TABLE: (OTLP_SUM_COLUMNS, tables[SUM_TABLE])}


def request_token(body: bytes, media: str) -> str:
    """The deduplication token of one request: the same body sent again (a retry) in the same encoding or over
    the same front-end (``media``: a content type, or ``grpc``) is the same batch."""
    return hashlib.blake2b(media.encode() + b"\0" + body, digest_size=16).hexdigest()


# --- metrics ----------------------------------------------------------------------------------------------


def metric_counts(request: ExportMetricsServiceRequest) -> tuple[int, int, str]:
    """How many points ``metric_rows`` stores, how many others were rejected, and why."""
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


def metric_rows(request: ExportMetricsServiceRequest) -> dict[str, list[tuple]]:
    """``{table: rows}`` for the gauge and sum points (the other kinds: see ``metric_counts``)."""
    tables: dict[str, list[tuple]] = {GAUGE_TABLE: [], SUM_TABLE: []}
    for resource_metrics in request.resource_metrics:
        resource = attribute_map(_attributes(resource_metrics.resource.attributes))
        service = resource.get("service.name", "")
        for scope_metrics in resource_metrics.scope_metrics:
            scope = scope_metrics.scope
            extra = (resource_metrics.schema_url, attribute_map(_attributes(scope.attributes)),
                     scope.dropped_attributes_count, scope_metrics.schema_url)  # fmt: skip
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind not in ("gauge", "sum"):
                    continue
                data = getattr(metric, kind)
                head = (resource, service, scope.name, scope.version, metric.name, metric.description, metric.unit)
                for point in data.data_points:
                    value = float(getattr(point, point.WhichOneof("value") or "as_double"))
                    row = (*head, attribute_map(_attributes(point.attributes)), point.start_time_unix_nano,
                           point.time_unix_nano, value)  # fmt: skip
                    if kind == "sum":
                        row = (*row, int(data.aggregation_temporality), data.is_monotonic)
                    tables[GAUGE_TABLE if kind == "gauge" else SUM_TABLE].append((*row, *extra, point.flags))
    return tables


# --- logs -------------------------------------------------------------------------------------------------

LOGS_TABLE = "otel_logs"
LOG_COLUMNS = (
    "Timestamp", "TraceId", "SpanId", "TraceFlags", "SeverityText", "SeverityNumber", "ServiceName", "Body",
    "ResourceSchemaUrl", "ResourceAttributes", "ScopeSchemaUrl", "ScopeName", "ScopeVersion", "ScopeAttributes",
    "LogAttributes",
)  # fmt: skip


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
            scope_head = (scope_logs.schema_url, scope.name, scope.version, attribute_map(_attributes(scope.attributes)))
            for record in scope_logs.log_records:
                rows.append((
                    record.time_unix_nano or record.observed_time_unix_nano, record.trace_id.hex(),
                    record.span_id.hex(), record.flags & 0xFF, record.severity_text, int(record.severity_number),
                    service, _body(record.body), resource_logs.schema_url, resource, *scope_head,
                    attribute_map(_attributes(record.attributes)),
                ))  # fmt: skip
    return rows


def log_counts(request: ExportLogsServiceRequest) -> int:
    return sum(len(s.log_records) for r in request.resource_logs for s in r.scope_logs)


def log_tables(payload: bytes) -> dict[str, tuple]:
    """A write-ahead record of an ``ExportLogsServiceRequest`` as rows (``records``)."""
    return {LOGS_TABLE: (LOG_COLUMNS, log_rows(ExportLogsServiceRequest.FromString(payload)))}


# the kinds of write-ahead record the receivers write, each with the function that makes its rows
TRACES = register("otlp_traces", trace_tables)
METRICS = register("otlp_metrics", metric_tables)
LOGS = register("otlp_logs", log_tables)


# --- the receiver -----------------------------------------------------------------------------------------


class _Every:
    """True at most once per ``seconds``: a misbehaving sender must not flood the agent's log."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._last = float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True


class OtlpReceiver:
    """OTLP/HTTP on ``listen`` into ``store`` until ``close``.

    With ``listen=None`` it serves no HTTP: it is then only the core that ``otlp_grpc`` hands its calls to.
    ``spool_dir``, ``headroom``: see :class:`~stagetrace.exporters.durable.DurableWriter`.
    """

    def __init__(self, store: Store, listen: str | None = DEFAULT_LISTEN, *, token: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_spans: int = MAX_SPANS, spool_dir=None,
                 max_in_flight: int = MAX_IN_FLIGHT, web=None, headroom=None, logs: bool = True,
                 part_guard=None):  # fmt: skip
        self.token = token
        self.logs_enabled = logs  # --otlp-logs none: log requests are refused
        self.max_body_bytes = max_body_bytes
        self.max_spans = max_spans
        self.max_in_flight = max_in_flight
        self.writer = DurableWriter(store, "spans", spool_dir=spool_dir, headroom=headroom, part_guard=part_guard)
        self._warn_rejected = _Every(60.0)
        handler = type("OtlpHandler", (_OtlpHandler,), {"receiver": self})
        try:
            self.listener = (httpd.start(handler, listen, "stagetrace-otlp", max_in_flight=max_in_flight, web=web)
                             if listen is not None else None)  # fmt: skip
        except BaseException:
            self.writer.close()
            raise

    @property
    def url(self) -> str | None:
        return self.listener.url if self.listener else None

    def close(self) -> None:
        """Stop taking requests, then store what was written ahead (up to ``CLOSE_FLUSH_S``; the rest waits in the
        spool for the next run)."""
        if self.listener:
            self.listener.close()
        self.writer.flush(CLOSE_FLUSH_S)
        self.writer.close()

    def traces(self, request: ExportTraceServiceRequest, token: str | None = None,
               body: bytes | None = None) -> ExportTraceServiceResponse:  # fmt: skip
        """Store the request's spans and answer; OtlpError when not stored. ``token``: its deduplication token;
        ``body``: the request as received in protobuf, written ahead as it is (else it is encoded again)."""
        valid, rejected = span_counts(request)
        if valid > self.max_spans:
            raise OtlpError(413, f"{valid} spans in one request are more than the receiver takes "
                                 f"({self.max_spans}): send smaller batches")  # fmt: skip
        if valid:
            self._write_ahead(TRACES, request, body, valid, token)
        response = ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = (
                f"{rejected} spans have an invalid trace or span ID (16 and 8 bytes, not all zero)"
            )
            if self._warn_rejected():
                logger.warning("OTLP: rejected %s", response.partial_success.error_message)
        return response

    def metrics(self, request: ExportMetricsServiceRequest, token: str | None = None,
                body: bytes | None = None) -> ExportMetricsServiceResponse:  # fmt: skip
        points, rejected, why = metric_counts(request)
        if points:
            self._write_ahead(METRICS, request, body, points, token)
        response = ExportMetricsServiceResponse()
        if rejected:
            response.partial_success.rejected_data_points = rejected
            response.partial_success.error_message = why
            if self._warn_rejected():
                logger.warning("OTLP: rejected %d metric points: %s", rejected, why)
        return response

    def logs(self, request: ExportLogsServiceRequest, token: str | None = None,
             body: bytes | None = None) -> ExportLogsServiceResponse:  # fmt: skip
        """Store the request's log records (bodies as the producer sent them) and answer; OtlpError when not
        stored, or when logs are turned off."""
        if not self.logs_enabled:
            raise OtlpError(404, "this agent takes no logs (--otlp-logs none): send them elsewhere or turn them on")
        records = log_counts(request)
        if records > self.max_spans:
            raise OtlpError(413, f"{records} log records in one request are more than the receiver takes "
                                 f"({self.max_spans}): send smaller batches")  # fmt: skip
        if records:
            self._write_ahead(LOGS, request, body, records, token)
        return ExportLogsServiceResponse()

    def _write_ahead(self, kind: RecordKind, request, body: bytes | None, rows: int, token: str | None) -> None:
        payload = body if body is not None else request.SerializeToString()
        try:
            written = self.writer.write_ahead(kind, payload, rows, token or new_token())
        except NoRoom as exc:  # below the free-space reserve: refused like a full spool, the sender retries
            raise OtlpError(503, f"{exc}: retry later", retry=True) from None
        if not written:
            why = ("the store is not taking inserts now and there is no spool" if self.writer.spool is None else
                   "the spool is full (the store has not taken inserts for long) or its disk refuses writes")  # fmt: skip
            raise OtlpError(503, f"{why}: retry later", retry=True)


_ROUTES = {
    "/v1/traces": (ExportTraceServiceRequest, OtlpReceiver.traces),
    "/v1/metrics": (ExportMetricsServiceRequest, OtlpReceiver.metrics),
    "/v1/logs": (ExportLogsServiceRequest, OtlpReceiver.logs),
}


class _OtlpHandler(httpd.Handler):
    receiver: OtlpReceiver

    def token_allowed(self) -> bool:
        return self.receiver.token is not None

    def do_POST(self):  # noqa: N802 - the stdlib's name
        media = media_type(self.headers.get("Content-Type"))
        answer_as = JSON if media == JSON else PROTOBUF
        try:
            route = _ROUTES.get(urlsplit(self.path).path.rstrip("/"))
            if route is None:
                raise OtlpError(404, f"no OTLP endpoint at {urlsplit(self.path).path}: use /v1/traces, /v1/metrics or /v1/logs",
                                body_read=False)  # fmt: skip
            if not self.admitted(self.receiver.token):
                raise OtlpError(401, "missing or wrong bearer token", body_read=False)
            if media not in (PROTOBUF, JSON):
                raise OtlpError(415, f"Content-Type {media or '(none)'} is not OTLP: use {PROTOBUF} or {JSON}",
                                body_read=False)  # fmt: skip
            request_class, accept = route
            body = httpd.read_body(self.headers, self.rfile, self.receiver.max_body_bytes)
            response = accept(self.receiver, decode(request_class(), body, media), request_token(body, media),
                              body if media == PROTOBUF else None)  # fmt: skip
        except httpd.HttpError as exc:
            self._error(exc, answer_as)
            return
        self.reply(200, encode(response, answer_as), answer_as)

    def too_busy(self):
        self._error(OtlpError(503, f"more than {self.receiver.max_in_flight} requests in flight: retry later",
                              retry=True, body_read=False), PROTOBUF)  # fmt: skip

    def _not_allowed(self):
        self._error(OtlpError(405, f"{self.command} is not allowed: OTLP/HTTP uses POST", body_read=False), PROTOBUF)

    do_GET = do_PUT = do_DELETE = do_PATCH = _not_allowed

    def _error(self, exc: httpd.HttpError, media: str) -> None:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if getattr(exc, "retry", False) else {}
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        elif exc.status == 405:
            headers["Allow"] = "POST"
        status = _RpcStatus(code=_RPC_CODE.get(exc.status, 2), message=exc.message)
        self.reply(exc.status, encode(status, media), media, headers, close=not exc.body_read)


__all__ = ["DEFAULT_LISTEN", "GAUGE_COLUMNS", "MAX_BODY_BYTES", "MAX_SPANS", "OTLP_SUM_COLUMNS", "OtlpError", "OtlpReceiver",
           "decode", "encode", "metric_counts", "metric_rows", "metric_tables", "request_token", "span_counts",
           "span_views", "trace_tables"]  # fmt: skip
