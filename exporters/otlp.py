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

Each OTLP span is read through a view (``rows.span_views``) that ``span_row`` takes like an SDK span, so it gets
exactly the columns the in-process ``ClickHouseSpanExporter`` writes. Gauge and sum points go to
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
from urllib.parse import urlsplit

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from stagetrace import httpd
from stagetrace.exporters.durable import DurableWriter, NoRoom
from stagetrace.exporters.records import RecordKind, register

# The rows are built in ``rows``; the names the receivers' callers import from here stay importable.
from stagetrace.exporters.rows import (
    COLUMNS,
    GAUGE_COLUMNS,
    GAUGE_TABLE,
    LOG_COLUMNS,
    LOGS_TABLE,
    OTLP_SUM_COLUMNS,
    SUM_TABLE,
    Resources,
    log_counts,
    log_rows,
    metric_counts,
    otlp_metric_rows,
    span_counts,
    span_row,
    span_views,
)
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
    fdp = descriptor_pb2.FileDescriptorProto(
        name="stagetrace/rpc_status.proto", package="google.rpc", syntax="proto3", dependency=[any_pb2.DESCRIPTOR.name]
    )
    message = fdp.message_type.add(name="Status")
    message.field.add(name="code", number=1, type=field.TYPE_INT32, json_name="code")
    message.field.add(name="message", number=2, type=field.TYPE_STRING, json_name="message")
    message.field.add(
        name="details",
        number=3,
        type=field.TYPE_MESSAGE,
        label=field.LABEL_REPEATED,
        type_name=".google.protobuf.Any",
        json_name="details",
    )
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


# --- write-ahead records: their rows, built by ``rows`` --------------------------------------------------


def trace_tables(payload: bytes) -> dict[str, tuple]:
    """A write-ahead record of an ``ExportTraceServiceRequest`` as rows (``records``)."""
    views, _ = span_views(ExportTraceServiceRequest.FromString(payload))
    resources = Resources()
    return {"otel_traces": (COLUMNS, [span_row(view, resources) for view in views])}


def metric_tables(payload: bytes) -> dict[str, tuple]:
    """A write-ahead record of an ``ExportMetricsServiceRequest`` as rows (``records``)."""
    tables = otlp_metric_rows(ExportMetricsServiceRequest.FromString(payload))
    return {GAUGE_TABLE: (GAUGE_COLUMNS, tables[GAUGE_TABLE]), SUM_TABLE: (OTLP_SUM_COLUMNS, tables[SUM_TABLE])}


def request_token(body: bytes, media: str) -> str:
    """The deduplication token of one request: the same body sent again (a retry) in the same encoding or over
    the same front-end (``media``: a content type, or ``grpc``) is the same batch."""
    return hashlib.blake2b(media.encode() + b"\0" + body, digest_size=16).hexdigest()


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

    def __init__(
        self,
        store: Store,
        listen: str | None = DEFAULT_LISTEN,
        *,
        token: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_spans: int = MAX_SPANS,
        spool_dir=None,
        max_in_flight: int = MAX_IN_FLIGHT,
        web=None,
        headroom=None,
        logs: bool = True,
        part_guard=None,
    ):
        self.token = token
        self.logs_enabled = logs  # --otlp-logs none: log requests are refused
        self.max_body_bytes = max_body_bytes
        self.max_spans = max_spans
        self.max_in_flight = max_in_flight
        self.writer = DurableWriter(store, "spans", spool_dir=spool_dir, headroom=headroom, part_guard=part_guard)
        self._warn_rejected = _Every(60.0)
        handler = type("OtlpHandler", (_OtlpHandler,), {"receiver": self})
        try:
            self.listener = (
                httpd.start(handler, listen, "stagetrace-otlp", max_in_flight=max_in_flight, web=web)
                if listen is not None
                else None
            )
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

    def traces(
        self, request: ExportTraceServiceRequest, token: str | None = None, body: bytes | None = None
    ) -> ExportTraceServiceResponse:
        """Store the request's spans and answer; OtlpError when not stored. ``token``: its deduplication token;
        ``body``: the request as received in protobuf, written ahead as it is (else it is encoded again)."""
        valid, rejected = span_counts(request)
        if valid > self.max_spans:
            raise OtlpError(
                413,
                f"{valid} spans in one request are more than the receiver takes "
                f"({self.max_spans}): send smaller batches",
            )
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

    def metrics(
        self, request: ExportMetricsServiceRequest, token: str | None = None, body: bytes | None = None
    ) -> ExportMetricsServiceResponse:
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

    def logs(
        self, request: ExportLogsServiceRequest, token: str | None = None, body: bytes | None = None
    ) -> ExportLogsServiceResponse:
        """Store the request's log records (bodies as the producer sent them) and answer; OtlpError when not
        stored, or when logs are turned off."""
        if not self.logs_enabled:
            raise OtlpError(404, "this agent takes no logs (--otlp-logs none): send them elsewhere or turn them on")
        records = log_counts(request)
        if records > self.max_spans:
            raise OtlpError(
                413,
                f"{records} log records in one request are more than the receiver takes "
                f"({self.max_spans}): send smaller batches",
            )
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
            why = (
                "the store is not taking inserts now and there is no spool"
                if self.writer.spool is None
                else "the spool is full (the store has not taken inserts for long) or its disk refuses writes"
            )
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
                raise OtlpError(
                    404,
                    f"no OTLP endpoint at {urlsplit(self.path).path}: use /v1/traces, /v1/metrics or /v1/logs",
                    body_read=False,
                )
            if not self.admitted(self.receiver.token):
                raise OtlpError(401, "missing or wrong bearer token", body_read=False)
            if media not in (PROTOBUF, JSON):
                raise OtlpError(
                    415, f"Content-Type {media or '(none)'} is not OTLP: use {PROTOBUF} or {JSON}", body_read=False
                )
            request_class, accept = route
            body = httpd.read_body(self.headers, self.rfile, self.receiver.max_body_bytes)
            response = accept(
                self.receiver,
                decode(request_class(), body, media),
                request_token(body, media),
                body if media == PROTOBUF else None,
            )
        except httpd.HttpError as exc:
            self._error(exc, answer_as)
            return
        self.reply(200, encode(response, answer_as), answer_as)

    def too_busy(self):
        self._error(
            OtlpError(
                503,
                f"more than {self.receiver.max_in_flight} requests in flight: retry later",
                retry=True,
                body_read=False,
            ),
            PROTOBUF,
        )

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


__all__ = [
    "DEFAULT_LISTEN",
    "GAUGE_COLUMNS",
    "MAX_BODY_BYTES",
    "MAX_SPANS",
    "OTLP_SUM_COLUMNS",
    "OtlpError",
    "OtlpReceiver",
    "decode",
    "encode",
    "metric_counts",
    "metric_tables",
    "request_token",
    "span_counts",
    "span_views",
    "trace_tables",
]
