"""``stagetrace divergences``: every group of same-input requests whose outputs disagree, with causes, persisted.

Grouping, majorities and first divergent stages come from ClickHouse (``population``); only the
deviating requests and their baselines' spans are read back to rank causes. The settings that
differ at the analysed requests' divergent stages are checked for rollouts; when one is found, the
requests are grouped again within the rollout's epochs, so the requests after it compare with each
other, the rollout is reported once, and the requests its wave explains are not counted as
deviating. Requests that sample without a seed are not compared at all, only counted. Results are
written to ``stagetrace_divergences`` (one row per deviating request; re-runs replace earlier rows)
for the dashboards and alert rules.
"""

from __future__ import annotations

import json
import time

from stagetrace import lookup
from stagetrace.analysis import population, rollouts
from stagetrace.analysis.explain import Baseline, contrast_window, diagnose, setting_keys, stage_differences, summary
from stagetrace.analysis.hardware import Samples
from stagetrace.store import Store

MARGIN_NS = 60 * 1_000_000_000

COLUMNS = (
    "DetectedAt", "RequestId", "TraceId", "RequestStart", "ServiceName", "HostName", "InputDigest",
    "BaselineRequestId", "BaselineHow", "FirstDivergentStage", "TopCauseKind", "TopCauseName", "TopCauseValue",
    "TopCauseBaselineValue", "TopCauseScore", "Causes", "Summary",
)  # fmt: skip
KEPT_CAUSES = 5
SAMPLED = 100  # deviations across the window whose differing settings are checked for rollouts


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
    window = (t0 - MARGIN_NS, until_ns + MARGIN_NS)
    deviations = population.deviations(store, t0, until_ns, MARGIN_NS)
    analysed = deviations[-limit:] if limit else deviations
    # rollouts are looked for among the settings that differ for the latest and for a sample across the window:
    # a rollout early in it makes the requests before it deviate, not the latest ones
    sample = list({id(d): d for d in analysed + deviations[::max(1, len(deviations) // SAMPLED)]}.values())
    traces = _traces(store, [t for d in sample for t in (d.trace_id, d.baseline_trace_id)], *window)
    pairs = [(d, traces[d.trace_id], traces[d.baseline_trace_id]) for d in sample
             if d.stage and d.trace_id in traces and d.baseline_trace_id in traces]  # fmt: skip
    candidates = sorted({(d.stage, k) for d, a, b in pairs for k in setting_keys(a, b, d.stage)})
    seen = rollouts.values_of(((span.stage, span) for t in traces.values() for span in t.spans if span.stage), candidates)
    found_rollouts = rollouts.detect(store, rollouts.suspects(seen), t0, until_ns)
    if found_rollouts:  # group again within the rollouts' epochs; the requests their waves explain are analysed too
        deviations = population.deviations(store, t0, until_ns, MARGIN_NS, [r.fleet_ns for r in found_rollouts])
    latest = {d.trace_id for d in (deviations[-limit:] if limit else deviations)}
    if found_rollouts:  # the latest of the new grouping, and every request in a wave
        analysed = [d for d in deviations if rollouts.in_wave(d.stage, d.start_ns, found_rollouts) or d.trace_id in latest]
        traces = _traces(store, [t for d in analysed for t in (d.trace_id, d.baseline_trace_id)], *window)

    keys: dict[str, set[str]] = {}
    for d in analysed:
        if d.stage and d.trace_id in traces and d.baseline_trace_id in traces:
            keys.setdefault(d.stage, set()).update(
                stage_differences(traces[d.trace_id], traces[d.baseline_trace_id], d.stage) or ())
    # weighed over the requests around the analysed ones, each against the majority of the whole window
    around = contrast_window(store, min((d.start_ns for d in analysed), default=t0), max((d.start_ns for d in analysed), default=until_ns))
    contrasts = population.contrasts(store, {stage: sorted(k) for stage, k in keys.items()}, max(around[0], t0),
                                     min(around[1], until_ns), found_rollouts, (t0, until_ns))  # fmt: skip
    samples = Samples(store, sorted({s.resource.get("host.name", "") for t in traces.values() for s in t.spans}), t0, until_ns)

    groups: dict[str, dict] = {}
    rows = []
    expected: dict[int, int] = {}  # rollout index → requests its wave explains
    detected = time.time_ns() // 1_000_000
    for d in analysed:
        baseline = Baseline(d.baseline_request_id, "majority", d.support, d.group_size)
        found = []
        if d.stage and d.trace_id in traces and d.baseline_trace_id in traces:
            found = diagnose(store, d.stage, traces[d.trace_id], traces[d.baseline_trace_id], contrasts.get(d.stage),
                             samples, found_rollouts)  # fmt: skip
        top = next((c for c in found if not c.weak), None)
        if top is not None and top.kind == "rollout" and top.evidence.get("expected"):
            index = next(i for i, r in enumerate(found_rollouts) if (r.stage, r.name) == (top.stage, top.name))
            expected[index] = expected.get(index, 0) + 1
            continue
        if limit and d.trace_id not in latest:
            continue
        group = groups.setdefault(d.input_digest, {"input_digest": d.input_digest, "requests": d.group_size,
                                                   "majority_output": d.majority_output, "support": d.support,
                                                   "deviating": []})  # fmt: skip
        line = summary(d.stage, found, baseline, d.input_differed)
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
    explained = sum(expected.values())
    return {
        "since_ns": since_ns,
        "deviating": len(deviations) - explained,
        "analysed": len(rows),
        "nondeterministic": population.nondeterministic(store, t0, until_ns),
        "rollouts": [{**r.to_json(), "requests": expected.get(i, 0)} for i, r in enumerate(found_rollouts)],
        "groups": list(groups.values()),
    }
