"""A prefix-cache hit that differs from the baseline's: a hit against a miss, or another cached prefix length.

The engine measures the hit per request (``conventions.cached_tokens``: SGLang's ``gen_ai.usage.cached_tokens`` on its
request root, the GenAI / OpenLLMetry / OpenInference cache-read counts). It is a measurement the engine made, on the
root, not a setting of the divergent stage's span, which is all the attribute contrast compares; so this detector
reads it from the whole request: from the spans in hand, else (``divergences`` reads stage spans only) from the
trace's spans in the store that carry it, one query for the request and its baseline. A request that records it on
several spans (a disaggregated request's prefill and decode roots) counts the largest. A request or baseline that
records no count has an unknown hit, not a miss: nothing is proposed.

The cause is named at the divergent stage, with the request's cache-stage spans (the KV transfer of a disaggregated
request, an application's own cache stage) in its evidence as where the hit was made. With batch invariance on for
both requests a hit is bit-exact with a miss: named as weak evidence, never blamed.
"""

from __future__ import annotations

from stagetrace import conventions, lookup
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register

# Below an expected rollout (1.0) and a GPU that missed a weight sync (0.97): a documented cause, but one that flips
# only near-tied tokens, so a setting the contrast finds separating requests nearly perfectly outranks it.
SCORE = 0.9
INVARIANT_WEIGHT = 0.2  # both ran batch-invariant: supporting evidence only
MARGIN_NS = 60 * 10**9  # a root opens before its trace's first stage span (SGLang's: before tokenize) and ends after

# The spans of these traces that record a prefix-cache hit, within their time. {spans}: otel_traces with Map attributes.
CACHED_TOKENS_SQL = """
SELECT TraceId, SpanName, SpanAttributes, ResourceAttributes
FROM {db:Identifier}.{spans:Identifier}
WHERE TraceId IN (SELECT arrayJoin({traces:Array(String)}))
  AND Timestamp >= fromUnixTimestamp64Nano({t0:Int64}) AND Timestamp <= fromUnixTimestamp64Nano({t1:Int64})
  AND hasAny(mapKeys(SpanAttributes), {keys:Array(String)})
"""


def hit(spans) -> tuple[str, int, str, dict] | None:
    """``(key, cached tokens, span name, resource)`` of the largest prefix-cache hit these spans record, or None.
    ``spans``: ``(name, attributes, resource)``."""
    found = [
        (*c, name.strip(), resource)
        for name, attributes, resource in spans
        if (c := conventions.cached_tokens(attributes))
    ]
    return max(found, key=lambda f: f[1], default=None)


def stored(store, traces: list[lookup.Trace]) -> dict[str, list[tuple]]:
    """The spans of these traces in the store that record a hit, by trace ID: one query for them all (``divergences``
    and the live analyser read them once for every request they analyse, as ``Case.cache_hits``)."""
    if not traces:
        return {}
    t0 = min(t.start_ns for t in traces) - MARGIN_NS
    t1 = max(t.start_ns + t.duration_ns for t in traces) + MARGIN_NS
    rows = store.client.query(
        CACHED_TOKENS_SQL,
        parameters={
            "db": store.database,
            "spans": store.readable("otel_traces"),
            "traces": sorted({t.trace_id for t in traces}),
            "t0": t0,
            "t1": t1,
            "keys": list(conventions.CACHED_TOKENS_KEYS),
        },
    ).result_rows
    out: dict[str, list[tuple]] = {}
    for trace_id, *span in rows:
        out.setdefault(trace_id, []).append(tuple(span))
    return out


def _invariant(trace: lookup.Trace) -> bool:
    return any(
        conventions.batch_invariant(s.attributes) or conventions.batch_invariant(s.resource) for s in trace.spans
    )


@register
class PrefixCache:
    name = "prefix_cache"

    def detect(self, case: Case) -> list[Cause]:
        if not case.stage:
            return []
        sides = (case.request, case.baseline)
        found = [hit((s.name, s.attributes, s.resource) for s in t.spans) for t in sides]
        missing = [t for t, h in zip(sides, found) if h is None]
        if missing:
            read = case.cache_hits if case.cache_hits is not None else stored(case.store, missing)
            found = [h or hit(read.get(t.trace_id, ())) for t, h in zip(sides, found)]
        mine, theirs = found
        if mine is None or theirs is None or mine[1] == theirs[1]:
            return []
        key, count, span, resource = mine
        invariant = _invariant(case.request) and _invariant(case.baseline)
        evidence = {
            "hit": count > 0,
            "baseline_hit": theirs[1] > 0,
            "span": span,
            "host": resource.get(conventions.HOST, ""),
        }
        cache_stage = sorted({s.name for s in case.request.spans if s.stage == "cache"})
        if cache_stage:
            evidence["cache_stage"] = cache_stage
        if invariant:
            evidence["neutral"] = "batch invariance on for both: a hit is bit-exact with a miss"
        return [
            Cause(
                "prefix_cache",
                case.stage,
                key,
                str(count),
                str(theirs[1]),
                SCORE * (INVARIANT_WEIGHT if invariant else 1.0),
                evidence,
                weak=invariant,
            )
        ]
