"""Trace lookup by request ID (through ``stagetrace_requests``) or by trace ID (through ``otel_traces_trace_id_ts``).

Both first find the trace's time window in a small table ordered by the ID, then read
``otel_traces`` for that trace inside the window, so a lookup never scans the span table's attributes.
What the conventions derive (a span's stage and digests, the request's ID and digests) is read from
``stagetrace_stages`` and ``stagetrace_requests``, where the store derived it, never re-derived here.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from stagetrace import conventions
from stagetrace.store import Store

# Spans of one request may come from other hosts (TP ranks) whose clocks differ a little.
S = 1_000_000_000
WINDOW_MARGIN_NS = 60 * S

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
    # from stagetrace_stages: empty for spans that are no stage
    stage_name: str = ""
    rank: str = ""
    input_digest: str = ""
    output_digest: str = ""

    @property
    def stage(self) -> str | None:
        return self.stage_name or None

    @property
    def engine_ms(self) -> dict[str, float]:
        """The engine's timings in milliseconds, by the name after ``gen_ai.latency.``; empty for other spans."""
        timings = {}
        for key, value in self.attributes.items():
            if key.startswith(ENGINE_LATENCY_PREFIX):
                try:
                    timings[key[len(ENGINE_LATENCY_PREFIX) :]] = round(float(value) * 1000, 6)  # to the ns
                except ValueError:
                    pass  # not a number: it stays among the attributes
        return timings

    def to_json(self) -> dict:
        engine = {"engine_ms": self.engine_ms} if self.engine_ms else {}
        derived = (
            {"rank": self.rank or None, "input_digest": self.input_digest, "output_digest": self.output_digest}
            if self.stage
            else {}
        )
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
            **derived,
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
    input_digest: str = ""
    output_digest: str = ""
    root_span_id: str = ""  # the span that stands for the request (conventions' root rule)

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "service": self.service,
            "start": iso_ns(self.start_ns),
            "duration_ms": self.duration_ns / 1e6,
            "input_digest": self.input_digest,
            "output_digest": self.output_digest,
            "spans": [s.to_json() for s in self.spans],
        }

    @functools.cached_property
    def stages(self) -> dict[tuple[str, str], list[Span]]:
        """Each stage's passes by (stage, TP rank), in pipeline order, then the other stages by start time (computed
        once: an analysis asks it of each trace many times)."""
        by_key: dict[tuple[str, str], list[Span]] = {}
        for span in self.spans:
            if span.stage:
                by_key.setdefault((span.stage, span.rank), []).append(span)
        passes = {key: conventions.stage_passes(spans) for key, spans in by_key.items()}
        order = {name: i for i, name in enumerate(conventions.PIPELINE_STAGES)}
        return dict(
            sorted(
                passes.items(),
                key=lambda kv: (order.get(kv[0][0], len(order)), kv[1][0].start_ns, conventions.rank_order(kv[0][1])),
            )
        )

    @property
    def root(self) -> Span:
        """The span that stands for the request: the root row's span, else the trace's root span."""
        by_id = next((s for s in self.spans if self.root_span_id and s.span_id == self.root_span_id), None)
        return by_id or next((s for s in self.spans if not s.parent_span_id), self.spans[0])


def iso_ns(ns: int) -> str:
    """RFC 3339 UTC with nanoseconds, e.g. ``2026-12-02T10:30:00.123456789Z``."""
    seconds, frac = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


# Every step of a lookup reads by a table's key (or the trace-ordered projection of stagetrace_requests), so it reads a
# bounded number of granules however large the store grows.
# The request a trace stands for, by the conventions' root rule (the projection by trace ID).
REQUEST_OF_TRACE_SQL = f"""
SELECT RequestId, InputDigest, OutputDigest, SpanId FROM ({
    conventions.requests_sql("TraceId = {tid:String}", "{db:Identifier}.stagetrace_requests")
})"""
# The traces recorded for a request ID (a retry has several), by the table's key.
TRACES_OF_REQUEST_SQL = """
SELECT TraceId, toUnixTimestamp64Nano(Start), toUnixTimestamp64Nano(End), ServiceName, SpanName
FROM {db:Identifier}.stagetrace_requests
WHERE RequestId = {rid:String}
ORDER BY Start
LIMIT 100"""
# The traces of many request IDs with their root's name, by the table's key: the halves of disaggregated requests.
HALVES_OF_REQUESTS_SQL = """
SELECT RequestId, TraceId, SpanName
FROM {db:Identifier}.stagetrace_requests
WHERE RequestId IN {rids:Array(String)}
ORDER BY Start
LIMIT 100 BY RequestId"""
# Traces' time spans, from the Collector's trace-ID table (ordered by trace ID): the first and after the last second
# their spans started in.
TRACE_SPANS_SQL = """
SELECT TraceId, toUnixTimestamp(min(Start)), toUnixTimestamp(max(End)) + 1
FROM {db:Identifier}.otel_traces_trace_id_ts
WHERE TraceId IN (SELECT arrayJoin({traces:Array(String)}))
GROUP BY TraceId"""


def _request(store: Store, trace_id: str) -> tuple[str | None, str, str, str]:
    """The request a trace stands for, by the conventions' root rule: (its ID, input and output digest, root span)."""
    rows = store.client.query(REQUEST_OF_TRACE_SQL, parameters={"db": store.database, "tid": trace_id}).result_rows
    return tuple(rows[0]) if rows else (None, "", "", "")


def by_request_id(store: Store, request_id: str) -> Trace:
    # the ID as given first; Dynamo's response ID ``chatcmpl-<id>`` then as the bare ID its spans record
    for candidate in conventions.request_id_candidates(request_id):
        rows = store.client.query(
            TRACES_OF_REQUEST_SQL, parameters={"db": store.database, "rid": candidate}
        ).result_rows
        if rows:
            break
    if not rows:
        hint = ""
        if re.fullmatch(r"[0-9a-fA-F]{32}", request_id.strip()) and _extent(store, request_id.strip().lower())[1]:
            hint = f" (it is a trace ID: stagetrace trace --trace-id {request_id.strip().lower()})"
        raise NotFound(f"no request with id {request_id!r}{hint}")
    # A retried request ID has several traces: show the latest. Within a trace the earliest row is the outermost span.
    # A request disaggregated over a prefill and a decode server is both halves, the latest of each (conventions).
    latest_trace = rows[-1][0]
    halves = _halves((r[0], r[4]) for r in rows)
    traces = [latest_trace, *(t for t in halves.values() if t != latest_trace)] if len(halves) > 1 else [latest_trace]
    trace_rows = [r for r in rows if r[0] == latest_trace]
    start = min(r[1] for r in rows if r[0] in traces)
    end = max(r[2] for r in rows if r[0] in traces)
    spans = []
    for trace_id in traces:
        # The whole trace's extent, from the trace-ID table: spans from a host whose clock runs minutes off, or that
        # started after the root ended. Its bounds are whole seconds around every span's start, so no margin is
        # needed: a margin would read a minute of every stage's rows either side. Without an entry there, the root
        # rows' span and a margin.
        first, last = _extent(store, trace_id)
        first, last = (
            (min(start, first), max(end, last)) if last else (start - WINDOW_MARGIN_NS, end + WINDOW_MARGIN_NS)
        )
        spans += _spans(store, trace_id, first, last)
    spans = in_trace_order(spans) if len(traces) > 1 else spans
    # An engine's request span (found by gen_ai.request.id) may sit inside a pipeline's trace: span it all.
    start = min([start, *(s.start_ns for s in spans)])
    end = max([end, *(s.start_ns + s.duration_ns for s in spans)])
    _, *request = _request(store, latest_trace)
    return Trace(request_id, latest_trace, trace_rows[0][3], start, end - start, spans, *request)


def _halves(rows) -> dict[str, str]:
    """Role -> the latest trace of that half of a disaggregated request, from its (trace ID, root name) rows in start
    order (conventions.disaggregated_role); empty for a request that is not split."""
    return {conventions.disaggregated_role(name): trace for trace, name in rows if conventions.disaggregated_role(name)}


def halves_of(store: Store, request_ids) -> dict[str, list[str]]:
    """Request ID -> the traces of its halves, for those of ``request_ids`` disaggregated over two servers (each
    half's latest trace, as ``by_request_id`` shows them), in one query."""
    rows: dict[str, list[tuple[str, str]]] = {}
    params = {"db": store.database, "rids": sorted(set(request_ids))}
    for request_id, trace_id, name in store.client.query(HALVES_OF_REQUESTS_SQL, parameters=params).result_rows:
        rows.setdefault(request_id, []).append((trace_id, name))
    out = {}
    for request_id, found in rows.items():
        halves = _halves(found)
        if len(halves) > 1:
            out[request_id] = sorted(set(halves.values()))
    return out


def _extents(store: Store, trace_ids) -> dict[str, tuple[int, int]]:
    """Trace ID → the first and after the last second (ns) its spans started in, by the trace-ID table."""
    rows = store.client.query(
        TRACE_SPANS_SQL, parameters={"db": store.database, "traces": sorted(set(trace_ids))}
    ).result_rows
    return {trace_id: (start * S, end * S) for trace_id, start, end in rows}


def _extent(store: Store, trace_id: str) -> tuple[int, int]:
    """One trace's :func:`_extents`; (0, 0) when the table has none of its spans."""
    return _extents(store, [trace_id]).get(trace_id, (0, 0))


def by_trace_id(store: Store, trace_id: str) -> Trace:
    trace_id = trace_id.strip().lower()
    start, end = _extent(store, trace_id)
    spans = _spans(store, trace_id, start, end) if end else []
    if not spans:
        raise NotFound(f"no trace with id {trace_id!r}")
    request_id, *request = _request(store, trace_id)
    service = next((s.service for s in spans if not s.parent_span_id), spans[0].service)
    end_ns = max(s.start_ns + s.duration_ns for s in spans)
    return Trace(request_id, trace_id, service, spans[0].start_ns, end_ns - spans[0].start_ns, spans, *request)


# Spans with what the store derived for them as stages. {traces}: the trace IDs; the window bounds both tables.
# {spans}: otel_traces with Map attributes, whichever layout the Collector stores (Store.readable).
SPANS_SQL = """
SELECT t.TraceId, t.SpanId, t.ParentSpanId, t.SpanName, t.SpanKind, t.ServiceName, toUnixTimestamp64Nano(t.Timestamp),
       t.Duration, t.StatusCode, t.StatusMessage, t.SpanAttributes, t.ResourceAttributes,
       s.Stage, s.Rank, s.InputDigest, s.OutputDigest
FROM {db:Identifier}.{spans:Identifier} AS t
LEFT JOIN (SELECT TraceId, SpanId, any(Stage) AS Stage, any(Rank) AS Rank, any(InputDigest) AS InputDigest,
                  any(OutputDigest) AS OutputDigest
           FROM {db:Identifier}.stagetrace_stages
           WHERE TraceId IN (SELECT arrayJoin({traces:Array(String)}))
             AND Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})
           GROUP BY TraceId, SpanId) AS s
    ON t.TraceId = s.TraceId AND t.SpanId = s.SpanId
WHERE t.TraceId IN (SELECT arrayJoin({traces:Array(String)}))
  AND t.Timestamp >= fromUnixTimestamp64Nano({t0:Int64}) AND t.Timestamp <= fromUnixTimestamp64Nano({t1:Int64})
ORDER BY t.Timestamp, t.SpanId
"""


# Only the stage spans, as the stages table keeps them (attributes without content; no kind or status): what a
# comparison of many requests stage by stage reads, without the span table's maps or the join (issue 28: 59,000
# traces of a busy minute, every granule of which holds some of them).
STAGE_SPANS_SQL = """
SELECT TraceId, SpanId, ParentSpanId, SpanName, '', ServiceName, toUnixTimestamp64Nano(Start), Duration, '', '',
       Attributes, ResourceAttributes, Stage, Rank, InputDigest, OutputDigest
FROM {db:Identifier}.stagetrace_stages
WHERE TraceId IN (SELECT arrayJoin({traces:Array(String)}))
  AND Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})
ORDER BY Start, SpanId
LIMIT 1 BY TraceId, SpanId
"""


def spans_of(
    store: Store, trace_ids: list[str], start_ns: int, end_ns: int, stages_only: bool = False
) -> dict[str, list[Span]]:
    """The spans of these traces within the window, by trace ID, in start order; ``stages_only``: their stage spans
    (``STAGE_SPANS_SQL``)."""
    out: dict[str, list[Span]] = {}
    params = {"db": store.database, "traces": trace_ids, "t0": start_ns, "t1": end_ns}
    if not stages_only:
        params["spans"] = store.readable("otel_traces")
    rows = store.client.query(STAGE_SPANS_SQL if stages_only else SPANS_SQL, parameters=params).result_rows
    for trace_id, *row in rows:
        out.setdefault(trace_id, []).append(Span(*row))
    return {trace_id: in_trace_order(spans) for trace_id, spans in out.items()}


def in_trace_order(spans: list[Span]) -> list[Span]:
    """Spans by start time; where starts tie (a stage and its parent opened in the same nanosecond, TP ranks started
    together), a parent before its children, then by TP rank, then by name and span ID. The SQL orders ties by span
    ID, which is random: a child showed above its root, and ranks as [3], [0], [2], [1], differently each lookup."""
    parents = {s.span_id: s.parent_span_id for s in spans}

    def depth(span: Span) -> int:
        steps, cursor, seen = 0, span.parent_span_id, set()
        while cursor in parents and cursor not in seen:
            seen.add(cursor)
            steps += 1
            cursor = parents[cursor]
        return steps

    return sorted(spans, key=lambda s: (s.start_ns, depth(s), conventions.rank_order(s.rank), s.name, s.span_id))


MAX_WINDOWS = 32  # queries one spans_of_many runs at most


def spans_of_many(
    store: Store, trace_ids, within: tuple[int, int], max_windows: int = MAX_WINDOWS, stages_only: bool = False
) -> dict[str, list[Span]]:
    """The spans of many traces within ``within``, read only in the seconds they ran (by the trace-ID table): traces
    close in time share one window, at most ``max_windows`` of them (the nearest merged), so that a few thousand
    traces cost what their seconds of spans cost, not the whole window's; ``stages_only``: their stage spans."""
    extents = sorted(
        (max(start, within[0]), min(end, within[1]), trace_id)
        for trace_id, (start, end) in _extents(store, trace_ids).items()
    )
    if not extents:
        return {}
    # windows split at the widest gaps between one trace's end and the next one's start
    reach = list(itertools.accumulate((e for _, e, _ in extents), max))  # the latest end so far
    gaps = sorted(((b[0] - reach[i], i) for i, b in enumerate(extents[1:]) if b[0] > reach[i]), reverse=True)
    out: dict[str, list[Span]] = {}
    first = 0
    for cut in sorted(i + 1 for _, i in gaps[: max_windows - 1]) + [len(extents)]:
        members = extents[first:cut]
        out.update(
            spans_of(store, [t for _, _, t in members], members[0][0], max(e for _, e, _ in members), stages_only)
        )
        first = cut
    return out


# The trace's log lines (otel_logs, the Collector's), by the bloom filter on TraceId inside the trace's time: a
# producer's log line for a request comes while it runs, or just after (a minute either side).
LOGS_SQL = """
SELECT toUnixTimestamp64Nano(Timestamp), SeverityText, SeverityNumber, ServiceName, SpanId, Body, LogAttributes
FROM {db:Identifier}.{logs:Identifier}
WHERE TraceId = {tid:String}
  AND Timestamp >= fromUnixTimestamp64Nano({t0:Int64}) AND Timestamp <= fromUnixTimestamp64Nano({t1:Int64})
ORDER BY Timestamp
LIMIT {limit:UInt64}"""


@dataclass
class LogLine:
    time_ns: int
    severity: str
    severity_number: int
    service: str
    span_id: str
    body: str
    attributes: dict

    def to_json(self) -> dict:
        return {
            "time": iso_ns(self.time_ns),
            "severity": self.severity,
            "service": self.service,
            "span_id": self.span_id or None,
            "body": self.body,
            "attributes": self.attributes,
        }


def logs_of(store: Store, trace: Trace, limit: int = 10_000) -> list[LogLine]:
    """The log lines of the trace, in time order (at most ``limit``); none where the store keeps no logs."""
    params = {
        "db": store.database,
        "tid": trace.trace_id,
        "t0": trace.start_ns - WINDOW_MARGIN_NS,
        "t1": trace.start_ns + trace.duration_ns + WINDOW_MARGIN_NS,
        "limit": limit,
        "logs": store.readable("otel_logs"),
    }
    rows = store.client.query(LOGS_SQL, parameters=params).result_rows
    return [
        LogLine(int(t), sev, int(num), service, span, body, dict(attrs))
        for t, sev, num, service, span, body, attrs in rows
    ]


def _spans(store: Store, trace_id: str, start_ns: int, end_ns: int) -> list[Span]:
    return spans_of(store, [trace_id], start_ns, end_ns).get(trace_id, [])


def resources(trace: Trace) -> list[dict]:
    """The resource attributes of the trace's processes that ``explain`` compares (``conventions.is_comparable``):
    an engine's attention backend, a driver version, the GPUs a process sees. One entry per distinct resource, in
    the order its spans come; host and service name it (they are not repeated among its attributes)."""
    found: dict[tuple, dict] = {}
    for span in trace.spans:
        shown = {
            k: v
            for k, v in sorted(span.resource.items())
            if conventions.is_comparable(k) and k not in (conventions.HOST, conventions.PEER_SERVICE)
        }
        key = (span.resource.get(conventions.HOST, ""), span.service, tuple(shown.items()))
        if shown and key not in found:
            found[key] = {"host": key[0], "service": span.service, "attributes": shown}
    return list(found.values())
