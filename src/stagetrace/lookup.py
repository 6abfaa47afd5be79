"""Trace lookup by request ID (through ``stagetrace_requests``) or by trace ID (through ``otel_traces_trace_id_ts``).

Both first find the trace's time window in a small table ordered by the ID, then read
``otel_traces`` for that trace inside the window, so a lookup never scans the span table's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from stagetrace.store import Store
from stagetrace.tracing import REQUEST_ID, STAGE

# Spans of one request may come from other hosts (TP ranks) whose clocks differ a little.
WINDOW_MARGIN_NS = 60 * 1_000_000_000

# Serving engines' own per-request timings, in seconds, on their request span (vLLM's llm_request):
# time_in_queue, time_to_first_token, time_in_model_prefill, time_in_model_decode, e2e, ...
ENGINE_LATENCY_PREFIX = "gen_ai.latency."


class NotFound(LookupError):
    """No request or trace with that ID."""


@dataclass
class Span:
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    service: str
    start_ns: int
    duration_ns: int
    status: str
    status_message: str
    attributes: dict[str, str]
    resource: dict[str, str]

    @property
    def stage(self) -> str | None:
        return self.attributes.get(STAGE)

    @property
    def engine_ms(self) -> dict[str, float]:
        """The engine's timings in milliseconds, by the name after ``gen_ai.latency.``; empty for other spans."""
        timings = {}
        for key, value in self.attributes.items():
            if key.startswith(ENGINE_LATENCY_PREFIX):
                try:
                    timings[key[len(ENGINE_LATENCY_PREFIX):]] = round(float(value) * 1000, 6)  # to the ns
                except ValueError:
                    pass  # not a number: it stays among the attributes
        return timings

    def to_json(self) -> dict:
        engine = {"engine_ms": self.engine_ms} if self.engine_ms else {}
        return {
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "stage": self.stage,
            "kind": self.kind,
            "service": self.service,
            "host": self.resource.get("host.name"),
            "start": iso_ns(self.start_ns),
            "duration_ms": self.duration_ns / 1e6,
            "status": self.status,
            **engine,
            "attributes": self.attributes,
        }


@dataclass
class Trace:
    request_id: str | None
    trace_id: str
    service: str
    start_ns: int
    duration_ns: int
    spans: list[Span] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "service": self.service,
            "start": iso_ns(self.start_ns),
            "duration_ms": self.duration_ns / 1e6,
            "spans": [s.to_json() for s in self.spans],
        }


def iso_ns(ns: int) -> str:
    """RFC 3339 UTC with nanoseconds, e.g. ``2026-12-02T10:30:00.123456789Z``."""
    seconds, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def by_request_id(store: Store, request_id: str) -> Trace:
    rows = store.client.query(
        """
        SELECT TraceId, toUnixTimestamp64Nano(Start), toUnixTimestamp64Nano(End), ServiceName
        FROM {db:Identifier}.stagetrace_requests
        WHERE RequestId = {rid:String}
        ORDER BY Start
        LIMIT 100
        """,
        parameters={"db": store.database, "rid": request_id},
    ).result_rows
    if not rows:
        raise NotFound(f"no request with id {request_id!r}")
    # A retried request ID has several traces: show the latest. Within a trace the earliest row is the outermost span.
    latest_trace = rows[-1][0]
    trace_rows = [r for r in rows if r[0] == latest_trace]
    start = min(r[1] for r in trace_rows)
    end = max(r[2] for r in trace_rows)
    spans = _spans(store, latest_trace, start - WINDOW_MARGIN_NS, end + WINDOW_MARGIN_NS)
    # An engine's request span (found by gen_ai.request.id) may sit inside a pipeline's trace: span it all.
    start = min([start, *(s.start_ns for s in spans)])
    end = max([end, *(s.start_ns + s.duration_ns for s in spans)])
    return Trace(request_id, latest_trace, trace_rows[0][3], start, end - start, spans)


def by_trace_id(store: Store, trace_id: str) -> Trace:
    trace_id = trace_id.strip().lower()
    start, end = store.client.query(
        """
        SELECT toUnixTimestamp(min(Start)), toUnixTimestamp(max(End)) + 1
        FROM {db:Identifier}.otel_traces_trace_id_ts
        WHERE TraceId = {tid:String}
        """,
        parameters={"db": store.database, "tid": trace_id},
    ).result_rows[0]
    spans = _spans(store, trace_id, start * 1_000_000_000, end * 1_000_000_000) if end > 1 else []
    if not spans:
        raise NotFound(f"no trace with id {trace_id!r}")
    roots = [s for s in spans if REQUEST_ID in s.attributes or "gen_ai.request.id" in s.attributes]
    root = roots[0] if roots else spans[0]
    request_id = root.attributes.get(REQUEST_ID) or root.attributes.get("gen_ai.request.id")
    end_ns = max(s.start_ns + s.duration_ns for s in spans)
    return Trace(request_id, trace_id, root.service, spans[0].start_ns, end_ns - spans[0].start_ns, spans)


def _spans(store: Store, trace_id: str, start_ns: int, end_ns: int) -> list[Span]:
    result = store.client.query(
        """
        SELECT SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, toUnixTimestamp64Nano(Timestamp),
               Duration, StatusCode, StatusMessage, SpanAttributes, ResourceAttributes
        FROM {db:Identifier}.otel_traces
        WHERE TraceId = {tid:String}
          AND Timestamp >= fromUnixTimestamp64Nano({start:Int64})
          AND Timestamp <= fromUnixTimestamp64Nano({end:Int64})
        ORDER BY Timestamp, SpanId
        """,
        parameters={"db": store.database, "tid": trace_id, "start": start_ns, "end": end_ns},
    )
    return [Span(*row) for row in result.result_rows]

