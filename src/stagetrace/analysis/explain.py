"""``stagetrace explain``: why one request's output deviates: its baseline, first divergent stage and ranked causes.

The baseline is ``--against`` another request, else the majority output among requests with the same
``stagetrace.input.digest`` within the window, else the nearest earlier request with that input.
From the majority it is the member nearest in time on another host, when there is one, so that the
hardware comparison sets other devices against the request's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from stagetrace import conventions, lookup
from stagetrace.analysis import causes as causes_module
from stagetrace.analysis import population
from stagetrace.analysis.causes import Cause, attribute_causes, hardware_causes, ranked
from stagetrace.analysis.hardware import Samples, devices
from stagetrace.conventions import PIPELINE_STAGES
from stagetrace.store import Store

HOUR_NS = 3600 * 1_000_000_000
DEFAULT_WINDOW_NS = 24 * HOUR_NS  # peers: requests with the same input this close in time
CONTRAST_WINDOW_NS = HOUR_NS  # the requests whose divergences weigh attribute differences...
CONTRAST_REQUESTS = 20_000  # ...narrowed around the request when more than this many fall in it


@dataclass
class Baseline:
    request_id: str
    how: str  # "explicit" | "majority" | "nearest_earlier"
    support: int  # requests with the baseline's output
    group_size: int  # requests with the request's input
    trace: lookup.Trace | None = None

    def describe(self) -> str:
        if self.how == "majority":
            return f"baseline: {self.support} of {self.group_size} requests"
        if self.how == "explicit":
            return f"baseline: request {self.request_id}"
        return f"baseline: the nearest earlier request {self.request_id}"

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "how": self.how, "support": self.support, "group_size": self.group_size}


def root(trace: lookup.Trace) -> lookup.Span:
    return trace.root


def stages(trace: lookup.Trace) -> dict[tuple[str, str], list[lookup.Span]]:
    """Each stage's passes by (stage, TP rank), in pipeline order, then the other stages by start time."""
    by_key: dict[tuple[str, str], list[lookup.Span]] = {}
    for span in trace.spans:
        if span.stage:
            by_key.setdefault((span.stage, span.rank), []).append(span)
    passes = {key: conventions.stage_passes(spans) for key, spans in by_key.items()}
    order = {name: i for i, name in enumerate(PIPELINE_STAGES)}
    return dict(sorted(passes.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[1][0].start_ns)))


def stage_spans(trace: lookup.Trace) -> dict[tuple[str, str], lookup.Span]:
    """Each stage's first pass by (stage, TP rank): the span whose attributes describe how the stage ran."""
    return {key: passes[0] for key, passes in stages(trace).items()}


@dataclass
class StageComparison:
    stage: str
    rank: str
    input_matches: bool
    output_matches: bool
    present: bool  # the request ran this stage

    def to_json(self) -> dict:
        return {"stage": self.stage, "rank": self.rank or None, "input_matches": self.input_matches,
                "output_matches": self.output_matches, "present": self.present}  # fmt: skip


def compare_stages(request: lookup.Trace, baseline: lookup.Trace) -> list[StageComparison]:
    mine, theirs = stages(request), stages(baseline)
    keys = list(theirs) + [k for k in mine if k not in theirs]
    out = []
    for key in keys:
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            out.append(StageComparison(key[0], key[1], False, False, a is not None))
            continue
        same_in = a[0].input_digest == b[0].input_digest
        same_out = conventions.combined_output(s.output_digest for s in a) == conventions.combined_output(
            s.output_digest for s in b)
        out.append(StageComparison(key[0], key[1], same_in, same_out, True))
    return out


def rank_causes(stage: str, rank: str, request: lookup.Trace, baseline: lookup.Trace, contrast,
                samples: Samples | None) -> list[Cause]:  # fmt: skip
    """Attribute and hardware causes for one divergent stage, best first."""
    mine = stage_spans(request).get((stage, rank))
    theirs = stage_spans(baseline).get((stage, rank))
    if mine is None:  # the request skipped a stage the baseline ran: compare the requests themselves
        mine, theirs = root(request), root(baseline)
    found = attribute_causes(stage, mine, theirs, contrast)
    if samples is not None:
        host = mine.resource.get("host.name", "")
        window = samples.window(host, mine.start_ns, mine.start_ns + mine.duration_ns)
        rises = samples.rises(host, *devices(mine.attributes), mine.start_ns, mine.start_ns + mine.duration_ns)
        baseline_rises = []
        if theirs is not None:
            baseline_rises = samples.rises(theirs.resource.get("host.name", ""), *devices(theirs.attributes),
                                           theirs.start_ns, theirs.start_ns + theirs.duration_ns)  # fmt: skip
        found += hardware_causes(stage, host, rises, baseline_rises, window)
    return ranked(found)


def summary(stage: str | None, top: Cause | None, baseline: Baseline, input_differed: bool = False) -> str:
    tail = f"({baseline.describe()})"
    if stage is None:
        return f"every recorded stage agrees with the baseline; the output differs after the last one {tail}"
    lead = f"{stage} diverged" + (" (its input already differed)" if input_differed else "")
    if top is None:
        return f"{lead}; no attribute or hardware difference was recorded {tail}"
    if top.kind == "hardware":
        return f"{lead}: {top.name} rose by {top.value.lstrip('+')} on {top.evidence['device']} ({top.evidence['host']}) while it ran, not for the baseline {tail}"
    return f"{lead}: {top.name} {top.value or '(unset)'} vs {top.baseline_value or '(unset)'} {tail}"


_WINDOW = "Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})"
# Requests with this input in the window, latest trace per request ID. The traces are found by their root rows'
# digests first, so only they are grouped into requests.
_PEERS_SQL = f"""
SELECT RequestId, argMax(TraceId, Start), toUnixTimestamp64Nano(max(Start)), argMax(HostName, Start),
       argMax(OutputDigest, Start)
FROM ({conventions.requests_sql(
    f"{_WINDOW} AND TraceId IN (SELECT TraceId FROM {{db:Identifier}}.stagetrace_requests "
    f"WHERE InputDigest = {{input:String}} AND {_WINDOW})", "{db:Identifier}.stagetrace_requests")})
WHERE InputDigest = {{input:String}}
GROUP BY RequestId"""


class Explainer:
    def __init__(self, store: Store, window_ns: int = DEFAULT_WINDOW_NS, contrast_window_ns: int = CONTRAST_WINDOW_NS):
        self.store = store
        self.window_ns = window_ns
        self.contrast_window_ns = contrast_window_ns

    def explain(self, request_id: str, against: str | None = None) -> dict:
        trace = lookup.by_request_id(self.store, request_id)
        input_digest, output_digest = trace.input_digest, trace.output_digest
        report = {"request_id": request_id, "trace_id": trace.trace_id, "input_digest": input_digest,
                  "output_digest": output_digest}  # fmt: skip
        if against is not None:
            try:
                other = lookup.by_request_id(self.store, against)
            except lookup.NotFound:
                raise lookup.NotFound(f"no request with id {against!r} (--against)") from None
            baseline = Baseline(against, "explicit", 1, 1, other)
        else:
            baseline = self._baseline(request_id, trace.start_ns, input_digest)
        if baseline is None:
            return {**report, "baseline": None, "diverged": False, "first_divergent_stage": None, "causes": [],
                    "summary": "no other request with the same input in the window: nothing to compare against"}  # fmt: skip
        base_output = baseline.trace.output_digest
        report["baseline"] = baseline.to_json()
        if base_output == output_digest:
            return {**report, "diverged": False, "first_divergent_stage": None, "causes": [],
                    "summary": f"the output agrees with the baseline ({baseline.describe()})"}  # fmt: skip
        stages = compare_stages(trace, baseline.trace)
        first = next((c for c in stages if not c.output_matches), None)
        found: list[Cause] = []
        if first is not None:
            contrast = self._contrast(first.stage, first.rank, trace, baseline.trace)
            hosts = {s.resource.get("host.name", "") for s in trace.spans + baseline.trace.spans}
            t0 = min(trace.start_ns, baseline.trace.start_ns)
            t1 = max(trace.start_ns + trace.duration_ns, baseline.trace.start_ns + baseline.trace.duration_ns)
            samples = Samples(self.store, sorted(hosts), t0, t1)
            found = rank_causes(first.stage, first.rank, trace, baseline.trace, contrast, samples)
        stage = first.stage if first else None
        input_differed = bool(first and first.present and not first.input_matches)
        return {
            **report,
            "diverged": True,
            "first_divergent_stage": stage,
            "stage_input_differed": input_differed,
            "stages": [c.to_json() for c in stages],
            "causes": [c.to_json() for c in found],
            "summary": summary(stage, found[0] if found else None, baseline, input_differed),
        }

    def _baseline(self, request_id: str, start_ns: int, input_digest: str) -> Baseline | None:
        if not input_digest:
            return None
        peers = self.store.client.query(
            _PEERS_SQL,
            parameters={"db": self.store.database, "input": input_digest, "t0": start_ns - self.window_ns,
                        "t1": start_ns + self.window_ns},  # fmt: skip
        ).result_rows
        outputs = {rid: out for rid, _, _, _, out in peers}
        others = [population.Member(rid, tid, int(start), host) for rid, tid, start, host, _ in peers if rid != request_id]
        host = next((h for rid, _, _, h, _ in peers if rid == request_id), "")
        counts = Counter(outputs.values())
        ranking = counts.most_common(2)
        if ranking and ranking[0][1] >= 2 and (len(ranking) == 1 or ranking[0][1] > ranking[1][1]):
            chosen = population.nearest([m for m in others if outputs[m.request_id] == ranking[0][0]], start_ns, host)
            if chosen:
                return Baseline(chosen.request_id, "majority", ranking[0][1], len(peers), lookup.by_request_id(self.store, chosen.request_id))
        earlier = [m for m in others if m.start_ns < start_ns]
        if not earlier:
            return None
        chosen = max(earlier, key=lambda m: m.start_ns)
        return Baseline(chosen.request_id, "nearest_earlier", counts[outputs[chosen.request_id]], len(peers),
                        lookup.by_request_id(self.store, chosen.request_id))  # fmt: skip

    def _contrast(self, stage: str, rank: str, trace: lookup.Trace, baseline: lookup.Trace):
        mine = stage_spans(trace).get((stage, rank))
        if mine is None:
            return None
        theirs = stage_spans(baseline).get((stage, rank))
        keys = [key for key, _, _ in causes_module.differences(mine, theirs)]
        half = self.contrast_window_ns
        count = int(self.store.client.command(
            "SELECT count() FROM {db:Identifier}.stagetrace_requests WHERE Start >= fromUnixTimestamp64Nano({t0:Int64}) "
            "AND Start < fromUnixTimestamp64Nano({t1:Int64})",
            parameters={"db": self.store.database, "t0": trace.start_ns - half, "t1": trace.start_ns + half},
        ))  # fmt: skip
        if count > CONTRAST_REQUESTS:  # busy hours: the nearest requests weigh as well, and explain stays fast
            half = half * CONTRAST_REQUESTS // count
        t0, t1 = trace.start_ns - half, trace.start_ns + half
        return population.contrast(self.store, stage, keys, population.deviations(self.store, t0, t1), t0, t1)
