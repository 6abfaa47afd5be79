"""``stagetrace divergences``: every group of same-input requests whose outputs disagree, with causes, persisted.

Grouping, majorities and baselines come from ClickHouse (``population``); only the analysed
deviating requests and their baselines' spans are read back, to find their first divergent stages
(compared as ``explain`` compares two requests) and rank causes. The settings that
differ at the analysed requests' divergent stages are checked for rollouts; when one is found, the
requests are grouped again within the rollout's epochs, so the requests after it compare with each
other, the rollout is reported once, and the requests its wave explains are not counted as
deviating. Requests that sample without a seed are not compared at all, only counted. Results are
written to ``stagetrace_divergences`` (one row per deviating request; re-runs replace earlier rows)
for the dashboards and alert rules. The GPU inventory (``analysis.inventory``) is read once per run and filled into
every trace read, as ``explain`` fills it, and the contrasts count spans with it too.

``compute`` finds them as data (``analysis.results``: a ``DivergenceReport``), ``record`` stores its rows, and ``find``
does both and returns the report's JSON, what ``stagetrace divergences --json`` prints.
"""

from __future__ import annotations

import time
from collections import Counter

from stagetrace import conventions, lookup
from stagetrace.analysis import inventory, population, ranks, rollouts, silent
from stagetrace.analysis.causes import RESOURCE, OnRank, attribute_causes, is_measurement, ranked
from stagetrace.analysis.comparison import (
    Divergence,
    ambiguous,
    compare_stages,
    confirmed,
    first_divergence,
    rank_settings,
    ranks_of,
    setting_keys,
    stage_differences,
)
from stagetrace.analysis.detectors import prefix_cache
from stagetrace.analysis.explain import REFERENCES, Baseline, contrast_window, diagnose, summary, unknown_seed
from stagetrace.analysis.hardware import Samples, devices

# COLUMNS, KEPT_CAUSES and began_columns are read from here too, where they were first
from stagetrace.analysis.results import (
    COLUMNS,
    KEPT_CAUSES,
    DeviatingRequest,
    DivergenceReport,
    InputGroup,
    TallyLine,
    began_columns,
)
from stagetrace.analysis.tenants import Tenancy, gpus_of
from stagetrace.store import Store

MARGIN_NS = 60 * 1_000_000_000

SAMPLED = 100  # deviations across the window whose differing settings are checked for rollouts
# The tally of every deviating request reads each one's stages and its baseline's: 5.3 s against 2.3 s without it
# for 100,000 requests (5,000 deviating), several times the analysis at a million. Beyond this many deviating
# requests the tally covers those analysed in full, and says so (``--limit 0`` analyses, and so tallies, all).
TALLY_ALL_MAX = 10_000
# The requests whose stages weigh causes, at most (more are sampled by input): five times what ``explain`` weighs
# around one request (``explain.CONTRAST_REQUESTS``).
CONTRAST_SAMPLE = 100_000


def _traces(
    store: Store,
    deviations: list[population.Deviation],
    window: tuple[int, int],
    gpus: inventory.Inventory,
    whole: bool = False,
) -> dict[str, lookup.Trace]:
    """The traces of these deviations and of their baselines, with what their processes did not record of their GPUs
    filled in from the inventory: their stage spans, which is what comparing them and ranking causes at a stage
    reads (a third of the time of whole traces at 10,000 requests/s), or ``whole``."""
    out = {}
    trace_ids = {t for d in deviations for t in (d.trace_id, d.baseline_trace_id)}
    found = lookup.spans_of_many(store, trace_ids, window, stages_only=not whole)
    _other_halves(store, deviations, found, window, whole)
    for trace_id, members in found.items():
        start = min(s.start_ns for s in members)
        end = max(s.start_ns + s.duration_ns for s in members)
        out[trace_id] = inventory.filled(
            lookup.Trace(None, trace_id, members[0].service, start, end - start, members), gpus
        )
    return out


def _other_halves(
    store: Store,
    deviations: list[population.Deviation],
    found: dict[str, list[lookup.Span]],
    window: tuple[int, int],
    whole: bool,
) -> None:
    """Add to each read trace of a disaggregated request the spans of its other half (SGLang's prefill and decode
    servers, each a trace of its own without a traced router), as ``explain`` reads the request: the other end of its
    KV transfer. Asked only of traces whose spans show a transfer (``conventions.moves_over_fabric``): one query."""
    request_of = {
        t: r for d in deviations for t, r in ((d.trace_id, d.request_id), (d.baseline_trace_id, d.baseline_request_id))
    }
    split = {
        request_of[t]
        for t, members in found.items()
        if t in request_of and any(conventions.moves_over_fabric(s.name) for s in members)
    }
    halves = lookup.halves_of(store, split) if split else {}
    if not halves:
        return
    wanted = {h for t in found if request_of.get(t) in halves for h in halves[request_of[t]] if h != t}
    read = {
        **{t: list(m) for t, m in found.items()},
        **lookup.spans_of_many(store, wanted - set(found), window, stages_only=not whole),
    }
    for trace_id, members in found.items():
        others = [h for h in halves.get(request_of.get(trace_id), []) if h != trace_id]
        members += [s for h in others for s in read.get(h, [])]


def _divergences(deviations: list[population.Deviation], traces: dict[str, lookup.Trace]) -> dict[str, Divergence]:
    """Trace ID → where each deviation first differs from its baseline, compared as ``explain`` compares them."""
    return {
        d.trace_id: first_divergence(compare_stages(traces[d.trace_id], traces[d.baseline_trace_id]))
        for d in deviations
        if d.trace_id in traces and d.baseline_trace_id in traces
    }


def _confirm(
    store: Store,
    deviations: list[population.Deviation],
    where: dict[str, Divergence],
    traces: dict[str, lookup.Trace],
    window: tuple[int, int],
) -> None:
    """Where several TP ranks began a deviation's difference against its baseline, the ranks confirmed against other
    requests with the majority output (``comparison.confirmed``): their members read in one query, their stages in
    another."""
    unsure = [d for d in deviations if ambiguous(where[d.trace_id])]
    if not unsure:
        return
    keys = {(d.service, d.input_digest, d.majority_output) for d in unsure}
    members = population.majority_members(store, keys, *window, REFERENCES + 1)
    chosen = {
        d.trace_id: [
            t
            for t in members.get((d.service, d.input_digest, d.majority_output), [])
            if t not in (d.trace_id, d.baseline_trace_id)
        ][:REFERENCES]
        for d in unsure
    }
    read = lookup.spans_of_many(store, {t for ts in chosen.values() for t in ts}, window, stages_only=True)
    for d in unsure:
        references = [
            lookup.Trace(None, t, read[t][0].service, 0, 0, read[t]) for t in chosen[d.trace_id] if read.get(t)
        ]
        where[d.trace_id] = confirmed(where[d.trace_id], traces[d.trace_id], references)


def _suspect_silent_corruption(
    store: Store,
    analysed: list[population.Deviation],
    where: dict[str, Divergence],
    diagnosed: dict[str, list],
    t0: int,
    t1: int,
) -> None:
    """Each unexplained deviation that began on a GPU which began ``silent.MIN_REQUESTS`` or more unexplained ones (in
    this run, or recorded before it in the window) gets the suspected silent data corruption first among its causes."""
    unexplained = [d for d in analysed if not any(not c.weak for c in diagnosed[d.trace_id])]
    suspects = {gpu for d in unexplained for gpu in silent.gpus(where[d.trace_id].origin)}
    if not suspects:
        return
    began = silent.recorded(store, suspects, t0, t1)
    for d in unexplained:
        for gpu in silent.gpus(where[d.trace_id].origin):
            began.setdefault(gpu, set()).add(d.request_id)
    for d in unexplained:
        diagnosed[d.trace_id] = silent.suspected(
            diagnosed[d.trace_id], where[d.trace_id].stage, where[d.trace_id].origin, began, d.request_id
        )


def _located(deviations: list[population.Deviation], where: dict[str, Divergence]):
    """The deviations with a divergent stage, each with where it diverged."""
    return [(d, where[d.trace_id]) for d in deviations if d.trace_id in where and where[d.trace_id].stage]


def find(
    store: Store,
    since_ns: int,
    until_ns: int | None = None,
    limit: int | None = 100,
    analyse_from_ns: int = 0,
    analyse=None,
    inputs_from_ns: int = 0,
    tally_all: bool | None = None,
) -> dict:
    """:func:`compute` (the same arguments), its rows stored (:func:`record`), as JSON: what ``stagetrace
    divergences --json`` prints."""
    report = compute(store, since_ns, until_ns, limit, analyse_from_ns, analyse, inputs_from_ns, tally_all)
    record(store, report)
    return report.to_json()


def record(store: Store, report: DivergenceReport) -> None:
    """Store one ``stagetrace_divergences`` row per analysed request (re-runs replace earlier rows); through a running
    agent's read-only endpoint, nothing (the report stands without being persisted)."""
    rows = report.rows()
    if rows and not store.read_only:
        store.client.insert("stagetrace_divergences", rows, column_names=COLUMNS, database=store.database)


def compute(
    store: Store,
    since_ns: int,
    until_ns: int | None = None,
    limit: int | None = 100,
    analyse_from_ns: int = 0,
    analyse=None,
    inputs_from_ns: int = 0,
    tally_all: bool | None = None,
) -> DivergenceReport:
    """Deviating requests of the last ``since_ns`` (the latest ``limit`` analysed in full, and only those that
    started at ``analyse_from_ns`` or later and, when ``analyse`` is given, for which ``analyse(deviation)`` is
    true: the live analyser's new ones), grouped by input; with ``inputs_from_ns``, only the groups of the inputs
    that arrived since then (the live analyser's: those the new requests can have changed), and the stage
    majorities that weigh the causes taken from the requests around the analysed ones, not the whole window.
    ``tally_all``: the tally covers every deviating request (where each first differs, found in SQL); off, only the
    analysed ones (the live analyser's passes, which do not show it and whose cost must follow the new traffic);
    None: every one up to ``TALLY_ALL_MAX`` deviating requests, the analysed ones beyond (the result says which)."""
    until_ns = until_ns or time.time_ns()
    t0 = until_ns - since_ns
    window = (t0 - MARGIN_NS, until_ns + MARGIN_NS)

    def chosen(found: list[population.Deviation]) -> list[population.Deviation]:
        recent = [d for d in found if d.start_ns >= analyse_from_ns and (analyse is None or analyse(d))]
        return recent[-limit:] if limit else recent

    deviations = population.deviations(store, t0, until_ns, inputs_from_ns=inputs_from_ns)
    if tally_all is None:
        tally_all = len(deviations) <= TALLY_ALL_MAX
    # the GPUs' inventory at the latest deviating request (nothing to read when none deviates)
    gpus = inventory.read(store, max(d.start_ns for d in deviations)) if deviations else inventory.Inventory({})
    # Where every deviation first differs (in SQL, for all of them): the settings a rollout may have moved, and the
    # tally. Rollouts are looked for among those settings, checked on a sample across the window and the latest
    # SAMPLED, so that what is found (and so which requests deviate) does not depend on how many are analysed.
    differences = (
        population.first_differences(store, t0, until_ns, window, inputs_from_ns=inputs_from_ns) if tally_all else {}
    )
    analysed = chosen(deviations)
    sample = list(
        {id(d): d for d in deviations[-SAMPLED:] + deviations[:: max(1, len(deviations) // SAMPLED)]}.values()
    )
    traces = _traces(store, list({id(d): d for d in analysed + sample}.values()), window, gpus)
    first = _divergences(sample, traces)
    candidates = {
        (where.stage, key)
        for d, where in _located(sample, first)
        for key in setting_keys(traces[d.trace_id], traces[d.baseline_trace_id], where.stage, where.ranks)
    }
    candidates |= {(found.stage, name) for found in differences.values() for name in _settings(found)}
    in_sample = {t for d in sample for t in (d.trace_id, d.baseline_trace_id)}
    seen = rollouts.values_of(
        ((s.stage, s) for t in traces.values() if t.trace_id in in_sample for s in t.spans if s.stage),
        sorted(candidates),
    )
    found_rollouts = rollouts.detect(store, rollouts.suspects(seen), t0, until_ns)
    if found_rollouts:  # group again within the rollouts' epochs; the requests their waves explain are analysed too
        epochs = population.epochs_of(found_rollouts)
        deviations = population.deviations(store, t0, until_ns, epochs, inputs_from_ns)
        if tally_all:
            differences = population.first_differences(store, t0, until_ns, window, epochs, inputs_from_ns)
    latest = {d.trace_id for d in chosen(deviations)}
    waves: set[str] = set()
    if found_rollouts:  # the latest of the new grouping, and every request in a wave
        during = [
            d
            for d in deviations
            if d.trace_id in latest or rollouts.in_wave(None, d.start_ns, found_rollouts, d.service)
        ]
        traces = _traces(store, during, window, gpus)
        first = _divergences(during, traces)
        waves = {
            d.trace_id
            for d in during
            if d.trace_id in first and rollouts.in_wave(first[d.trace_id].stage, d.start_ns, found_rollouts, d.service)
        }
        analysed = [d for d in during if d.trace_id in latest or d.trace_id in waves]
    else:
        first = _divergences(analysed, traces)
    nowhere = Divergence(None, [], False)  # the request's or its baseline's spans are gone
    where = {d.trace_id: first.get(d.trace_id, nowhere) for d in analysed}
    _confirm(store, [d for d in analysed if d.trace_id in traces], where, traces, window)
    # a request that skipped the stage where its baseline differs is compared with it by their root spans: read whole
    skipped = [d for d, at in _located(analysed, where) if not ranks_of(traces[d.trace_id], at.stage)]
    if skipped:
        traces.update(_traces(store, skipped, window, gpus, whole=True))

    keys: dict[str, set[str]] = {}
    for d, at in _located(analysed, where):
        keys.setdefault(at.stage, set()).update(
            stage_differences(traces[d.trace_id], traces[d.baseline_trace_id], at.stage, at.ranks) or ()
        )
    # weighed over the requests around the analysed ones, each against the majority of the whole window (a live
    # pass: of the requests around, so that its cost follows the new traffic here too)
    starts = [d.start_ns for d in analysed]
    around = contrast_window(store, min(starts, default=t0), max(starts, default=until_ns))
    around = (max(around[0], t0), min(around[1], until_ns))
    # analysed requests spread over a busy minute put every request of it around them: weigh a sample of inputs
    # as large as CONTRAST_SAMPLE, not all of them
    sample = population.requests_in(store, *around) // CONTRAST_SAMPLE if keys else 1
    contrasts = population.contrasts(
        store,
        {stage: sorted(k) for stage, k in keys.items()},
        *around,
        found_rollouts,
        around if inputs_from_ns else (t0, until_ns),
        inventory=gpus,
        sample=sample,
    )
    # the settings of the ranks that began TP differences by their contribution, weighed on those ranks' own spans
    on_rank: dict[str, tuple[str, str, str]] = {}
    wanted: dict[tuple[str, str, str], set[str]] = {}
    for d, at in _located(analysed, where):
        found = rank_settings(traces[d.trace_id], traces[d.baseline_trace_id], at)
        if found is not None:
            on_rank[d.trace_id] = (at.stage, found[0], ranks_of(traces[d.trace_id], at.stage)[found[0]].service)
            wanted.setdefault(on_rank[d.trace_id], set()).update(found[1])
    rank_contrasts = population.rank_contrasts(store, {k: sorted(v) for k, v in wanted.items()}, *around)

    def contrast_of(d: population.Deviation, stage: str):
        at = on_rank.get(d.trace_id)
        by_rank = rank_contrasts.get(at) if at else None
        stage_contrast = contrasts.get((stage, d.peer))
        return OnRank(stage_contrast, by_rank, at[1]) if by_rank is not None else stage_contrast

    hosts = sorted({s.resource.get("host.name", "") for t in traces.values() for s in t.spans})
    samples = Samples(store, hosts, t0, until_ns)
    read = [t for t in traces.values() if t.spans]
    tenancy = Tenancy(
        store,
        gpus_of(s for t in read for s in t.spans),
        min((t.start_ns for t in read), default=t0),
        max((t.start_ns + t.duration_ns for t in read), default=t0),
    )

    groups: dict[str, InputGroup] = {}
    items: list[DeviatingRequest] = []
    expected: dict[int, int] = {}  # rollout index → requests its wave explains
    explained_ids: set[str] = set()
    detected = time.time_ns() // 1_000_000
    diagnosed = {}
    # the prefix-cache hits the analysed requests and their baselines record, in one query, not one a request
    cache_hits = prefix_cache.stored(
        store,
        [
            traces[t]
            for d in analysed
            if where[d.trace_id].stage
            for t in (d.trace_id, d.baseline_trace_id)
            if t in traces
        ],
    )
    for d in analysed:
        stage = where[d.trace_id].stage
        if where[d.trace_id].origin is not None:
            ranks.at(where[d.trace_id].origin, traces[d.trace_id], stage, traces.get(d.baseline_trace_id))
        diagnosed[d.trace_id] = (
            diagnose(
                store,
                stage,
                traces[d.trace_id],
                traces[d.baseline_trace_id],
                contrast_of(d, stage),
                samples,
                found_rollouts,
                tenancy=tenancy,
                began=where[d.trace_id].ranks,
                cache_hits=cache_hits,
            )
            if stage
            else []
        )
    _suspect_silent_corruption(store, analysed, where, diagnosed, t0, until_ns)
    for d in analysed:
        baseline = Baseline(d.baseline_request_id, "majority", d.support, d.group_size)
        stage = where[d.trace_id].stage
        found = diagnosed[d.trace_id]
        top = next((c for c in found if not c.weak), None)
        # a wave's requests are all analysed, whatever the limit: the rollout explains those (not counted as deviating)
        if top is not None and top.kind == "rollout" and top.evidence.get("expected") and d.trace_id in waves:
            index = next(
                i
                for i, r in enumerate(found_rollouts)
                if (r.stage, r.name, r.service) == (top.stage, top.name, top.evidence["rollout"]["service"])
            )
            expected[index] = expected.get(index, 0) + 1
            explained_ids.add(d.trace_id)
            continue
        if d.trace_id not in latest:
            continue
        group = groups.setdefault(
            d.input_digest, InputGroup(d.input_digest, d.group_size, d.majority_output, d.support)
        )
        origin = where[d.trace_id].origin
        item = DeviatingRequest(
            d.request_id,
            d.trace_id,
            d.service,
            d.host,
            d.start_ns,
            d.input_digest,
            baseline,
            stage,
            origin,
            found,
            summary(stage, found, baseline, where[d.trace_id].input_differed, where[d.trace_id].ranks, origin),
            ",".join(stage_devices(traces.get(d.trace_id), stage, where[d.trace_id].ranks)),
            unknown_seed(traces.get(d.trace_id)),
        )
        group.deviating.append(item)
        items.append(item)
    explained = sum(expected.values())
    tops = {item.trace_id: item.top.name if item.top else "" for g in groups.values() for item in g.deviating}
    if tally_all:
        remaining = [d for d in deviations if d.trace_id not in explained_ids]
        by_request = _tally_causes(store, remaining, differences, tops, t0, until_ns, found_rollouts, gpus)
    else:  # the analysed requests' own
        remaining = [d for d in deviations if d.trace_id in tops]
        by_request = {d.trace_id: (where[d.trace_id].stage or "", tops[d.trace_id]) for d in remaining}
    return DivergenceReport(
        since_ns=since_ns,
        deviating=len(deviations) - explained,
        analysed_expected=len(latest & explained_ids),
        nondeterministic_by_service=population.nondeterministic_by_service(store, t0, until_ns),
        rollouts=[(r, expected.get(i, 0)) for i, r in enumerate(found_rollouts)],
        tally=tally(remaining, by_request, set(tops), _began_on(remaining, where, differences)),
        tally_covers="all" if tally_all else "analysed",
        groups=list(groups.values()),
        requests=items,
        detected_ms=detected,
    )


def stage_devices(trace: lookup.Trace | None, stage: str | None, began) -> list[str]:
    """The GPUs (else the NICs) the stage's spans ran on: those of the ranks that began the difference, when known
    (a span's own ``gpu.uuid``, else its process's)."""
    if trace is None or not stage:
        return []
    spans = [s for s in trace.spans if s.stage == stage and (not began or s.rank in began)]
    gpus = sorted({g for s in spans for g in devices(s.attributes)[0]}) or sorted(
        {g for s in spans for g in devices({conventions.GPU_UUID: ranks.gpu_of(s)})[0]}
    )
    return gpus or sorted({n for s in spans for n in devices(s.attributes)[1]})


def _settings(found: population.Difference) -> list[str]:
    """The contrast keys of the settings (not measurements) that differ at a deviation's first divergent stage."""
    keys = [name for name, _, _ in found.attributes] + [RESOURCE + name for name, _, _ in found.resource]
    return [key for key in keys if conventions.is_comparable(key.removeprefix(RESOURCE)) and not is_measurement(key)]


def _span(stage: str, attributes: dict, resource: dict, start_ns: int) -> lookup.Span:
    """A stage span as far as its differing attributes tell (what ``attribute_causes`` weighs)."""
    return lookup.Span("", "", stage, "", "", start_ns, 0, "", "", attributes, resource, stage_name=stage)


def _tally_causes(
    store: Store,
    deviations: list[population.Deviation],
    differences: dict,
    tops: dict[str, str],
    t0: int,
    t1: int,
    found_rollouts,
    gpus,
) -> dict[str, tuple[str, str]]:
    """Trace ID → (first divergent stage, cause) of every deviation: an analysed one's top cause; for the others the
    setting the attribute detector ranks first at that stage (its contrast weighed over the whole window), "" when
    none stands out (a hardware fault, which only the full analysis reads counters for, shows so)."""
    keys: dict[str, set[str]] = {}
    for d in deviations:
        found = differences.get(d.trace_id)
        if found is not None and d.trace_id not in tops:
            keys.setdefault(found.stage, set()).update(
                k
                for k in [n for n, _, _ in found.attributes] + [RESOURCE + n for n, _, _ in found.resource]
                if conventions.is_comparable(k.removeprefix(RESOURCE))
            )
    contrasts = (
        population.contrasts(
            store, {stage: sorted(k) for stage, k in keys.items()}, t0, t1, found_rollouts, inventory=gpus
        )
        if keys
        else {}
    )
    out = {}
    for d in deviations:
        found = differences.get(d.trace_id)
        stage = found.stage if found else ""
        if d.trace_id in tops:
            out[d.trace_id] = (stage, tops[d.trace_id])
            continue
        cause = ""
        if found is not None:
            mine = _span(
                stage, {n: v for n, v, _ in found.attributes}, {n: v for n, v, _ in found.resource}, d.start_ns
            )
            theirs = _span(
                stage, {n: b for n, _, b in found.attributes}, {n: b for n, _, b in found.resource}, d.start_ns
            )
            # a setting, never an identity: without the counters only the full analysis reads, a host or GPU that
            # separates the deviating requests is where they ran, not why (the tally line lists the hosts)
            top = next(
                (
                    c
                    for c in ranked(attribute_causes(stage, mine, theirs, contrasts.get((stage, d.peer))))
                    if not c.weak and not conventions.is_identity(c.name)
                ),
                None,
            )
            cause = top.name if top is not None else ""
        out[d.trace_id] = (stage, cause)
    return out


def _began_on(
    deviations: list[population.Deviation], where: dict[str, Divergence], differences: dict[str, population.Difference]
) -> dict[str, str]:
    """Trace ID → ``GPU (host)`` of the TP rank that began each deviation's difference, where one did: an analysed
    request's from its comparison, another's from the tally's SQL (``population.first_differences``)."""
    out = {}
    for d in deviations:
        origin = where[d.trace_id].origin if d.trace_id in where else None
        if origin is not None and origin.how != ranks.UPSTREAM and origin.places:
            place = origin.places[0]
            gpu, host = place["gpu"], place["host"]
        elif d.trace_id in differences and differences[d.trace_id].rank:
            gpu, host = differences[d.trace_id].gpu, differences[d.trace_id].host
        else:
            continue
        if gpu or host:
            out[d.trace_id] = f"{gpu} ({host})" if gpu and host else gpu or host
    return out


def tally(
    deviations: list[population.Deviation],
    by_request: dict[str, tuple[str, str]],
    analysed: set[str],
    began_on: dict[str, str] | None = None,
) -> list[TallyLine]:
    """Every deviating request (not only those analysed in full) by cause and first divergent stage, most first: how
    many, how many of them were analysed in full, on which hosts, first and last seen (so 80 requests of one index
    rebuild read as one line, whatever ``--limit`` is). A line per service: one service's fault is not another's.
    ``began_on``: per trace, the GPU and host of the TP rank that began it; a line counts its requests by them
    (``began_on``, where any), so that one GPU's many requests read as such."""
    by: dict[tuple[str, str, str], list[population.Deviation]] = {}
    for d in deviations:
        stage, cause = by_request.get(d.trace_id, ("", ""))
        by.setdefault((cause, stage, d.service), []).append(d)
    began_on = began_on or {}
    lines = []
    for (cause, stage, service), items in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        on = Counter(began_on[d.trace_id] for d in items if d.trace_id in began_on)
        lines.append(
            TallyLine(
                cause,
                stage,
                service,
                len(items),
                sum(d.trace_id in analysed for d in items),
                sorted({d.host for d in items}),
                lookup.iso_ns(min(d.start_ns for d in items)),
                lookup.iso_ns(max(d.start_ns for d in items)),
                dict(on.most_common()),
            )
        )
    return lines
