"""``stagetrace divergences``: every group of same-input requests whose outputs disagree, with causes, persisted.

Grouping, majorities and first divergent stages come from ClickHouse (``population``); only the
deviating requests and their baselines' spans are read back to rank causes. Results are written to
``stagetrace_divergences`` (one row per deviating request; re-runs replace earlier rows) for the
dashboards and alert rules.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from stagetrace import lookup
from stagetrace.analysis import population
from stagetrace.analysis.causes import differences
from stagetrace.analysis.explain import Baseline, rank_causes, stage_spans, summary
from stagetrace.analysis.hardware import Samples
from stagetrace.store import Store

MARGIN_NS = 60 * 1_000_000_000

COLUMNS = (
    "DetectedAt", "RequestId", "TraceId", "RequestStart", "ServiceName", "HostName", "InputDigest",
    "BaselineRequestId", "BaselineHow", "FirstDivergentStage", "TopCauseKind", "TopCauseName", "TopCauseValue",
    "TopCauseBaselineValue", "TopCauseScore", "Causes", "Summary",
)  # fmt: skip
KEPT_CAUSES = 5


def _traces(store: Store, trace_ids: list[str], t0_ns: int, t1_ns: int) -> dict[str, lookup.Trace]:
    out = {}
    for trace_id, members in lookup.spans_of(store, trace_ids, t0_ns, t1_ns).items():
        start = min(s.start_ns for s in members)
        end = max(s.start_ns + s.duration_ns for s in members)
        out[trace_id] = lookup.Trace(None, trace_id, members[0].service, start, end - start, members)
    return out


def find(store: Store, since_ns: int, until_ns: int | None = None, limit: int | None = 100) -> dict:
    """Deviating requests of the last ``since_ns`` (the latest ``limit`` analysed in full), grouped by input."""
    until_ns = until_ns or time.time_ns()
    t0 = until_ns - since_ns
    deviations = population.deviations(store, t0, until_ns, MARGIN_NS)
    analysed = deviations[-limit:] if limit else deviations
    traces = _traces(store, [t for d in analysed for t in (d.trace_id, d.baseline_trace_id)], t0 - MARGIN_NS,
                     until_ns + MARGIN_NS)  # fmt: skip

    keys: dict[str, set[str]] = defaultdict(set)
    for d in analysed:
        if d.stage and d.trace_id in traces and d.baseline_trace_id in traces:
            mine = stage_spans(traces[d.trace_id]).get((d.stage, d.rank))
            if mine is not None:
                theirs = stage_spans(traces[d.baseline_trace_id]).get((d.stage, d.rank))
                keys[d.stage].update(key for key, _, _ in differences(mine, theirs))
    contrasts = {stage: population.contrast(store, stage, sorted(k), deviations, t0, until_ns, MARGIN_NS)
                 for stage, k in keys.items()}  # fmt: skip
    samples = Samples(store, sorted({s.resource.get("host.name", "") for t in traces.values() for s in t.spans}), t0, until_ns)

    groups: dict[str, dict] = {}
    rows = []
    detected = time.time_ns() // 1_000_000
    for d in analysed:
        group = groups.setdefault(d.input_digest, {"input_digest": d.input_digest, "requests": d.group_size,
                                                   "majority_output": d.majority_output, "support": d.support,
                                                   "deviating": []})  # fmt: skip
        baseline = Baseline(d.baseline_request_id, "majority", d.support, d.group_size)
        found = []
        if d.stage and d.trace_id in traces and d.baseline_trace_id in traces:
            found = rank_causes(d.stage, d.rank, traces[d.trace_id], traces[d.baseline_trace_id],
                                contrasts.get(d.stage), samples)  # fmt: skip
        top = found[0] if found else None
        line = summary(d.stage, top, baseline, d.input_differed)
        group["deviating"].append({
            "request_id": d.request_id, "trace_id": d.trace_id, "baseline_request_id": baseline.request_id,
            "first_divergent_stage": d.stage, "top_cause": top.to_json() if top else None, "summary": line,
        })  # fmt: skip
        service = traces[d.trace_id].service if d.trace_id in traces else ""
        rows.append((
            detected, d.request_id, d.trace_id, d.start_ns, service, d.host, d.input_digest, baseline.request_id,
            baseline.how, d.stage or "", top.kind if top else "", top.name if top else "", top.value if top else "",
            top.baseline_value if top else "", top.score if top else 0.0,
            json.dumps([c.to_json() for c in found[:KEPT_CAUSES]]), line,
        ))  # fmt: skip
    if rows and not store.read_only:  # through a running agent's read-only endpoint, report without persisting
        store.client.insert("stagetrace_divergences", rows, column_names=COLUMNS, database=store.database)
    return {"since_ns": since_ns, "deviating": len(deviations), "analysed": len(analysed), "groups": list(groups.values())}
