"""``stagetrace explain``: why one request's output deviates: its baseline, first divergent stage and ranked causes.

The baseline is ``--against`` another request, else the majority output among requests with the same
``stagetrace.input.digest`` within the window, else the nearest earlier request with that input;
from the majority it is the member nearest in time on another host, when there is one, so that the
hardware comparison sets other devices against the request's. Baselines respect the fleet's moves:
when a setting that differs from the baseline's was rolled out in between (``rollouts``), the
baseline is chosen again among the requests on the request's side of the rollout. Requests that
sample without a seed are compared only with each other.

At a TP stage the difference is localized to the rank that began it (``analysis.ranks``: the rank whose
contribution first differed, not every rank that summed it), and the causes are weighed on that rank's spans; a GPU
that began many unexplained differences is a suspected silent data corruption (``analysis.silent``).

The causes come from the detectors (``analysis.detectors``), ranked together; the verdict names the
strongest, and says so plainly when nothing recorded explains the divergence. Spans whose process recorded no
GPU model or driver get those of the GPU they ran on from the agent's inventory (``analysis.inventory``), read
once per explanation, before the request and its baseline are compared.
"""

from __future__ import annotations

from collections import Counter

from stagetrace import config, conventions, lookup
from stagetrace.analysis import detectors, inventory, population, rollouts, silent, tenants
from stagetrace.analysis import ranks as _ranks
from stagetrace.analysis.causes import RESOURCE, Cause, OnRank, differences, is_measurement, ranked
from stagetrace.analysis.comparison import (
    ambiguous,
    compare_stages,
    confirmed,
    first_divergence,
    rank_settings,
    ranks_of,
    stage_differences,
    stage_spans,
)
from stagetrace.analysis.hardware import Samples, Timing
from stagetrace.analysis.results import Baseline, Explanation
from stagetrace.store import Store

HOUR_NS = 3600 * 1_000_000_000
DEFAULT_WINDOW_NS = 24 * HOUR_NS  # peers: requests with the same input this close in time
CONTRAST_WINDOW_NS = HOUR_NS  # the requests whose divergences weigh attribute differences...
CONTRAST_REQUESTS = 20_000  # ...narrowed around the request when more than this many fall in it
WEAK_NAMED = 3  # weak candidates named in a verdict that found nothing strong
SUSPECT_PEERS = 64  # the peers nearest in time whose settings hint at a rollout
REFERENCES = population.REFERENCES  # other requests with the majority output TP ranks are checked against


def _trace_of(trace_id: str, spans: list[lookup.Span]) -> lookup.Trace:
    """A trace of the spans read for it (its stages, for comparing them)."""
    start = min(s.start_ns for s in spans)
    return lookup.Trace(
        None, trace_id, spans[0].service, start, max(s.start_ns + s.duration_ns for s in spans) - start, spans
    )


def root(trace: lookup.Trace) -> lookup.Span:
    return trace.root


rank_order = conventions.rank_order


def nondeterminism(trace: lookup.Trace) -> str:
    """Why the request's output may differ by design (its own or a stage span's sampling), or ``''``."""
    return next((r for r in (conventions.nondeterminism(s.attributes) for s in trace.spans) if r), "")


def unknown_seed(trace: lookup.Trace | None) -> str:
    """Why the request samples with a seed nobody recorded (an engine that never exports it, and no span of the
    request that does), or ``''``: compared as if seeded, and said, never excused as sampling
    (``conventions.unknown_seed``)."""
    if not trace or any(conventions.records_seed(s.attributes) for s in trace.spans):
        return ""  # the seed is known where the request records it: an app's span above the engine's
    return next((r for r in (conventions.unknown_seed(s.attributes, s.name) for s in trace.spans) if r), "")


def contrast_window(store: Store, lo_ns: int, hi_ns: int, half_ns: int = CONTRAST_WINDOW_NS) -> tuple[int, int]:
    """The requests whose divergences weigh attribute differences: ``half_ns`` either side of [lo, hi], narrowed
    when more than ``CONTRAST_REQUESTS`` started in it (busy hours: the nearest weigh as well, and it stays fast)."""
    count = population.requests_in(store, lo_ns - half_ns, hi_ns + half_ns)
    if count > CONTRAST_REQUESTS:
        half_ns = half_ns * CONTRAST_REQUESTS // count
    return lo_ns - half_ns, hi_ns + half_ns


def rollout_candidates(trace: lookup.Trace) -> list[tuple[str, str]]:
    """(stage, contrast key) of every setting the request's stages ran with: what a rollout may have moved."""
    out = set()
    for (stage, _), span in stage_spans(trace).items():
        for key, _, _ in differences(span, None):
            if not is_measurement(key) and key != RESOURCE + conventions.HOST:
                out.add((stage, key))
    return sorted(out)


def diagnose(
    store: Store,
    stage: str,
    request: lookup.Trace,
    baseline: lookup.Trace,
    contrast,
    samples: Samples | None,
    found_rollouts: list,
    reason: str = "",
    tenancy=None,
    began: list[str] = (),
    cache_hits: dict | None = None,
) -> list[Cause]:
    """Every detector's causes for one divergent stage, ranked (``tenancy``: the GPUs' tenants, ``cache_hits``: the
    stored prefix-cache hits, each read once for many requests; None reads this request's). ``began``: the ranks
    that began the difference (``ranks.locate``); the detectors look at those ranks' spans alone (their GPU, host,
    counters and settings), not the lowest rank's."""
    mine, theirs = ranks_of(request, stage), ranks_of(baseline, stage)
    if any(r in mine for r in began):
        mine = {r: span for r, span in mine.items() if r in began}
    if not mine:  # the request skipped a stage the baseline ran: compare the requests themselves
        mine, theirs = {"": root(request)}, {"": root(baseline)}
    if theirs and set(theirs) != set(mine):  # other TP ranks on each side: a rank faces its own or the lowest
        lowest = theirs[min(theirs, key=rank_order)]
        theirs = {rank: theirs.get(rank, lowest) for rank in mine}
    case = detectors.Case(
        store, request, baseline, stage, mine, theirs, contrast, samples, found_rollouts, reason, tenancy, cache_hits
    )
    return sourced(ranked(detectors.detect(case)), case.span, case.baseline_span)


def sourced(causes: list[Cause], span: lookup.Span, baseline: lookup.Span | None) -> list[Cause]:
    """The causes, each resource setting that the GPU inventory supplied (not the process) saying so."""
    mine = set(inventory.filled_names(span.resource))
    theirs = set(inventory.filled_names(baseline.resource)) if baseline else set()
    for cause in causes:
        if cause.kind == "attribute" and cause.evidence.get("resource"):
            if cause.name in mine:
                cause.evidence["from"] = conventions.INVENTORY_METRIC
            if cause.name in theirs:
                cause.evidence["baseline_from"] = conventions.INVENTORY_METRIC
    return causes


def summary(
    stage: str | None,
    causes: list[Cause],
    baseline: Baseline,
    input_differed: bool = False,
    ranks: list[str] = (),
    origin: _ranks.Origin | None = None,
) -> str:
    """The one-line verdict; it names the baseline's request ID so that ``stagetrace trace`` can open it. With the
    ``origin`` of a TP stage's difference, it says which rank began it, on which GPU and host, and which received
    it."""
    tail = f"({baseline.describe()})"
    top = next((c for c in causes if not c.weak), None)
    if top is not None and top.kind == "nondeterminism":
        return f"nondeterministic: {top.value}; its output may differ from any other by design {tail}"
    if stage is None:
        return f"every recorded stage agrees with the baseline; the output differs after the last one {tail}"
    began = _ranks.describe(origin, stage) if origin is not None else ""
    if began:  # the ranks that began it, with their GPU and host; the cause follows after a semicolon
        lead, sep = f"{stage} diverged on {_ranks.where(origin)}: {began}", ";"
    else:
        where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}" if ranks and len(ranks) < 8 else ""
        lead, sep = f"{stage} diverged{where}" + (" (its input already differed)" if input_differed else ""), ":"
    if top is None:
        weak = ", ".join(c.name for c in [c for c in causes if not c.evidence.get("neutral")][:WEAK_NAMED])
        return (
            f"{lead}; no recorded setting or hardware signal differs; {stage} itself is nondeterministic or an "
            f"unrecorded input changed" + (f" (weak candidates: {weak})" if weak else "") + f" {tail}"
        )
    if top.kind == "sdc":
        ev = top.evidence
        return (
            f"{lead}; suspected silent data corruption: {ev['gpu']} ({ev['host']}) began the difference in "
            f"{ev['requests']} requests with no error counter or setting recorded against it {tail}"
        )
    if top.kind == "rollout":
        rollout = top.evidence["rollout"]
        if top.evidence.get("expected"):
            return f"{lead} as expected: {rollout['summary']} {tail}"
        return (
            f"{lead}{sep} {top.evidence['host']} still had {top.name} {top.value} after the fleet moved to "
            f"{top.baseline_value} ({rollout['hosts']}/{rollout['of_hosts']} hosts) {tail}"
        )
    if top.kind == "weights":
        ev = top.evidence
        return (
            f"{lead}{sep} {ev['gpu']} ({ev['host']}) used weights of step {top.value} ({top.name}) while its fleet "
            f"served {top.baseline_value} ({ev['gpus_on_fleet_step']}/{ev['gpus']} other GPUs, since "
            f"{ev['fleet_step_since'][:19].replace('T', ' ')} UTC): it missed a weight sync {tail}"
        )
    if top.kind == "hardware" and "tenant" in top.evidence:
        rank = f" rank {top.evidence['rank']}'s" if top.evidence.get("rank") else " its"
        return (
            f"{lead}{sep}{rank} GPU {tenants.describe(top.name, top.evidence)} while it ran, not for the "
            f"baseline {tail}"
        )
    if top.kind == "hardware":
        rank = f" rank {top.evidence['rank']}," if top.evidence.get("rank") else ""
        change = f"rose by {top.value.lstrip('+')}" if top.value.startswith("+") else f"was {top.value}"
        usual = f" (usually {top.evidence['typical']:g})" if "typical" in top.evidence else ""
        timing = Timing.of(top.evidence)  # the window the detector weighed, as the report draws it
        when = timing.words(stage) if timing else "while it ran"
        half = f", the {top.evidence['half']} end of the KV transfer" if top.evidence.get("half") else ""
        return (
            f"{lead}{sep} {top.name} {change}{usual} {when} on{rank} {top.evidence['device']} "
            f"({top.evidence['host']}{half}), not for the baseline {tail}"
        )
    value, usual = top.value or "(unset)", top.baseline_value or "(unset)"
    where = top.evidence.get("where") or {}
    host = where.get(conventions.HOST) or next(iter(where.values()), "")
    together = top.evidence.get("together") or []
    if together:
        names = " and ".join(
            f"{c['name']} {c['value'] or '(unset)'}" for c in [{"name": top.name, "value": value}, *together]
        )
        return (
            f"{lead}{sep} {names} changed together{f' on {host}' if host else ''} and cannot be told apart here "
            f"(a host with one and not the others would tell them apart) {tail}"
        )
    known = conventions.KNOWN_CAUSES.get(top.name)
    known = f"; known: {known}" if known else ""
    if host:
        return f"{lead}{sep} {host} runs {top.name} {value} where its peers run {usual}{known} {tail}"
    return f"{lead}{sep} {top.name} {value} vs {usual}{known} {tail}"


_WINDOW = "Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start <= fromUnixTimestamp64Nano({t1:Int64})"
# Requests with this input in the window, latest trace per request ID, and whether each samples by design.
# The traces are found by their root rows' digests first, so only they are grouped into requests.
# Each with its service and model, which make its peer key (``conventions.peer_of``).
_PEERS_SQL = f"""
SELECT RequestId, argMax(TraceId, Start), toUnixTimestamp64Nano(max(Start)), argMax(HostName, Start),
       argMax(OutputDigest, Start), argMax(TraceId, Start) IN (
           {
    conventions.nondeterministic_traces_sql(
        _WINDOW, "{db:Identifier}.stagetrace_requests", "{db:Identifier}.stagetrace_stages"
    )
}),
       argMax(ServiceName, Start), argMax(Model, Start)
FROM ({
    conventions.requests_sql(
        f"{_WINDOW} AND TraceId IN (SELECT TraceId FROM {{db:Identifier}}.stagetrace_requests "
        f"WHERE InputDigest = {{input:String}} AND {_WINDOW})",
        "{db:Identifier}.stagetrace_requests",
        model=True,
    )
})
WHERE InputDigest = {{input:String}}
GROUP BY RequestId"""


class Explainer:
    def __init__(self, store: Store, window_ns: int = DEFAULT_WINDOW_NS, contrast_window_ns: int = CONTRAST_WINDOW_NS):
        self.store = store
        self.window_ns = window_ns
        self.contrast_window_ns = contrast_window_ns

    def explain(self, request_id: str, against: str | None = None) -> Explanation:
        trace = lookup.by_request_id(self.store, request_id)
        reason = nondeterminism(trace)
        report = Explanation(
            request_id,
            trace.trace_id,
            trace.input_digest,
            trace.output_digest,
            bool(reason),
            reason or None,
            unknown_seed(trace) or None,
        )
        if against is not None:
            try:
                other = lookup.by_request_id(self.store, against)
            except lookup.NotFound:
                raise lookup.NotFound(f"no request with id {against!r} (--against)") from None
            baseline = Baseline(against, "explicit", 1, 1, other)
        peers, peer = self._peers(request_id, trace.start_ns, trace.input_digest, bool(reason))
        if peer is None:  # no input digest to find its row by: its own root span's service, and its model
            model = conventions.request_model(
                [(trace.root.attributes, trace.root.resource, trace.root.name)] if trace.spans else [],
                [(s.stage_name, s.start_ns, s.attributes, s.resource) for s in trace.spans if s is not trace.root],
            )
            peer = conventions.peer_of(trace.service, model, config.peer_key())
        found_rollouts = self._rollouts(trace, peers)
        epochs = population.epochs_of(found_rollouts)
        if against is None:
            # peers on the request's side of every rollout; with none there, across it (the rollout explains it)
            baseline = self._baseline(request_id, trace.start_ns, peers, epochs) or self._baseline(
                request_id, trace.start_ns, peers, []
            )
        if baseline is None:
            report.summary = "no other request with the same input in the window: nothing to compare against"
            return report
        report.baseline, report.rollouts = baseline, found_rollouts
        if baseline.trace.output_digest == trace.output_digest:
            report.summary = f"the output agrees with the baseline ({baseline.describe()})"
            return report
        # what the processes did not record of their GPUs, from the inventory: for the spans compared here and
        # for those the contrast counts
        gpus = inventory.read(self.store, trace.start_ns)
        trace, baseline.trace = inventory.filled(trace, gpus), inventory.filled(baseline.trace, gpus)
        comparisons = compare_stages(trace, baseline.trace)
        first = first_divergence(comparisons)
        if ambiguous(first):
            first = confirmed(first, trace, self._references(peers, baseline, trace))
        stage = first.stage
        if first.origin is not None:
            _ranks.at(first.origin, trace, stage, baseline.trace)
        found: list[Cause] = []
        if stage is not None:
            contrast = self._contrast(
                stage,
                trace,
                baseline.trace,
                found_rollouts,
                gpus,
                peer,
                first.ranks,
                rank_settings(trace, baseline.trace, first),
            )
            hosts = {s.resource.get("host.name", "") for s in trace.spans + baseline.trace.spans}
            t0 = min(trace.start_ns, baseline.trace.start_ns)
            t1 = max(trace.start_ns + trace.duration_ns, baseline.trace.start_ns + baseline.trace.duration_ns)
            samples = Samples(self.store, sorted(hosts), t0, t1)
            found = diagnose(
                self.store, stage, trace, baseline.trace, contrast, samples, found_rollouts, reason, began=first.ranks
            )
            suspects = silent.gpus(first.origin) if not any(not c.weak for c in found) else []
            if suspects:  # what the analyser recorded of the same GPUs: one query over its small table
                began = silent.recorded(
                    self.store, suspects, trace.start_ns - self.window_ns, trace.start_ns + self.window_ns
                )
                found = silent.suspected(found, stage, first.origin, began, request_id)
        elif reason:
            found = diagnose(self.store, "", trace, baseline.trace, None, None, [], reason)
        top = next((c for c in found if not c.weak), None)
        report.diverged = True
        report.expected = bool(top and top.kind == "rollout" and top.evidence.get("expected"))
        report.first_divergent_stage, report.divergent_ranks, report.origin = stage, first.ranks, first.origin
        report.stage_input_differed, report.stages, report.causes = first.input_differed, comparisons, found
        report.summary = summary(stage, found, baseline, first.input_differed, first.ranks, first.origin)
        return report

    def _peers(
        self, request_id: str, start_ns: int, input_digest: str, nondeterministic: bool
    ) -> tuple[list[tuple], tuple[str, str] | None]:
        """(request ID, trace ID, start, host, output, service) of the request's peers: the requests with its input and
        its peer key (``conventions.peer_of``: its service and model), sampling alike; and that key."""
        if not input_digest:
            return [], None
        rows = self.store.client.query(
            _PEERS_SQL,
            parameters={
                "db": self.store.database,
                "input": input_digest,
                "t0": start_ns - self.window_ns,
                "t1": start_ns + self.window_ns,
            },
        ).result_rows
        key = config.peer_key()
        peer = next((conventions.peer_of(row[6], row[7], key) for row in rows if row[0] == request_id), None)
        return [
            (*row[:5], row[6])
            for row in rows
            if conventions.peer_of(row[6], row[7], key) == peer
            and (bool(row[5]) == nondeterministic or row[0] == request_id)
        ], peer

    def _references(self, peers: list[tuple], baseline: Baseline, trace: lookup.Trace) -> list[lookup.Trace]:
        """Up to ``REFERENCES`` other peers with the baseline's output, nearest the request in time: their stage
        spans, read in one query."""
        output = baseline.trace.output_digest
        chosen = sorted(
            (p for p in peers if p[4] == output and p[0] not in (baseline.request_id, trace.request_id)),
            key=lambda p: abs(int(p[2]) - trace.start_ns),
        )[:REFERENCES]
        if not chosen:
            return []
        within = (trace.start_ns - self.window_ns, trace.start_ns + self.window_ns)
        read = lookup.spans_of_many(self.store, [p[1] for p in chosen], within, stages_only=True)
        return [_trace_of(tid, spans) for tid, spans in read.items()]

    def _baseline(self, request_id: str, start_ns: int, peers: list[tuple], epochs) -> Baseline | None:
        """The majority (or nearest earlier) among the peers on the request's side of every epoch of its service."""

        def side(t: int, service: str) -> tuple:
            return tuple(service == s and t >= e for e, s in epochs)

        service = next((p[5] for p in peers if p[0] == request_id), "")
        peers = [p for p in peers if side(int(p[2]), p[5]) == side(start_ns, service)]
        outputs = {rid: out for rid, _, _, _, out, _ in peers}
        others = [
            population.Member(rid, tid, int(start), host) for rid, tid, start, host, _, _ in peers if rid != request_id
        ]
        host = next((h for rid, _, _, h, _, _ in peers if rid == request_id), "")
        counts = Counter(outputs.values())
        ranking = counts.most_common(2)
        if ranking and ranking[0][1] >= 2 and (len(ranking) == 1 or ranking[0][1] > ranking[1][1]):
            chosen = population.nearest([m for m in others if outputs[m.request_id] == ranking[0][0]], start_ns, host)
            if chosen:
                return Baseline(
                    chosen.request_id,
                    "majority",
                    ranking[0][1],
                    len(peers),
                    lookup.by_request_id(self.store, chosen.request_id),
                )
        earlier = [m for m in others if m.start_ns < start_ns]
        if not earlier:
            return None
        chosen = max(earlier, key=lambda m: m.start_ns)
        return Baseline(
            chosen.request_id,
            "nearest_earlier",
            counts[outputs[chosen.request_id]],
            len(peers),
            lookup.by_request_id(self.store, chosen.request_id),
        )

    def _rollouts(self, trace: lookup.Trace, peers: list[tuple]) -> list:
        """Rollouts of the settings the request ran with, looked for in the window where its peers suggest one."""
        nearest = sorted(peers, key=lambda p: abs(int(p[2]) - trace.start_ns))[:SUSPECT_PEERS]
        return rollouts.detect(
            self.store,
            rollout_candidates(trace),
            trace.start_ns - self.window_ns,
            trace.start_ns + self.window_ns,
            among=[(trace.trace_id, trace.start_ns)] + [(p[1], int(p[2])) for p in nearest],
        )

    def _contrast(
        self,
        stage: str,
        trace: lookup.Trace,
        baseline: lookup.Trace,
        found_rollouts: list,
        gpus: inventory.Inventory | None = None,
        peer: tuple[str, str] = ("", ""),
        began: list[str] = (),
        on_rank: tuple[str, list[str]] | None = None,
    ):
        """The stage's contrast; ``on_rank``: (rank, keys) of the beginning rank's settings, weighed on its own spans
        too (``rank_settings``: one more query)."""
        keys = stage_differences(trace, baseline, stage, began)
        if keys is None:
            return None
        t0, t1 = contrast_window(self.store, trace.start_ns, trace.start_ns, self.contrast_window_ns)
        found = population.contrast(
            self.store,
            stage,
            keys,
            t0,
            t1,
            found_rollouts,
            (trace.start_ns - self.window_ns, trace.start_ns + self.window_ns),
            inventory=gpus,
            peer=peer,
        )
        if on_rank is None:
            return found
        at = (stage, on_rank[0], ranks_of(trace, stage)[on_rank[0]].service)
        by_rank = population.rank_contrasts(self.store, {at: on_rank[1]}, t0, t1).get(at)
        return OnRank(found, by_rank, on_rank[0]) if by_rank is not None else found
