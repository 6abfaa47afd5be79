"""Comparing a request's stages with its baseline's, and where the difference began.

Stage by stage, rank by rank where both ran the same TP ranks (``compare_stages``); the first stage whose output
differs, at the ranks that began it there (``first_divergence``, ``ranks.locate``), checked against other requests
with the majority output where several ranks began it (``confirmed``); and the settings that differ at that stage
(``stage_differences``, ``rank_settings``, ``setting_keys``). ``explain`` compares one request so, ``divergences``
every deviating one.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace import conventions, lookup
from stagetrace.analysis import ranks as _ranks
from stagetrace.analysis.causes import RESOURCE, differences, is_measurement

rank_order = conventions.rank_order


def stages(trace: lookup.Trace) -> dict[tuple[str, str], list[lookup.Span]]:
    """Each stage's passes by (stage, TP rank), in pipeline order, then the other stages by start time."""
    return trace.stages


def stage_spans(trace: lookup.Trace) -> dict[tuple[str, str], lookup.Span]:
    """Each stage's first pass by (stage, TP rank): the span whose attributes describe how the stage ran."""
    return {key: passes[0] for key, passes in stages(trace).items()}


def ranks_of(trace: lookup.Trace, stage: str) -> dict[str, lookup.Span]:
    """The stage's first pass per TP rank (``""``: no rank recorded)."""
    return {rank: span for (name, rank), span in stage_spans(trace).items() if name == stage}


@dataclass
class StageComparison:
    stage: str
    rank: str
    input_matches: bool
    output_matches: bool
    present: bool  # the request ran this stage
    first_step: int | None = None  # the first step whose input differs, where both record their steps' inputs
    steps: bool = False  # both record their steps' inputs

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "rank": self.rank or None,
            "input_matches": self.input_matches,
            "output_matches": self.output_matches,
            "present": self.present,
        }


def compare_stages(request: lookup.Trace, baseline: lookup.Trace) -> list[StageComparison]:
    """Stage by stage in the baseline's order: rank by rank where both ran the same TP ranks, else the stage as a
    whole by the set of its ranks' outputs (a TP group across hosts against an engine that records one span)."""
    mine, theirs = _by_stage(stages(request)), _by_stage(stages(baseline))
    out = []
    for stage in list(theirs) + [s for s in mine if s not in theirs]:
        a, b = mine.get(stage, {}), theirs.get(stage, {})
        if not a or not b:
            out += [StageComparison(stage, rank, False, False, bool(a)) for rank in (a or b)]
            continue
        if set(a) == set(b):
            for rank in sorted(b, key=rank_order):
                out.append(
                    StageComparison(
                        stage,
                        rank,
                        a[rank][0].input_digest == b[rank][0].input_digest,
                        _output(a[rank]) == _output(b[rank]),
                        True,
                        _first_step(a[rank][0], b[rank][0]),
                        _has_steps(a[rank][0]) and _has_steps(b[rank][0]),
                    )
                )
            continue
        first_a, first_b = a[min(a, key=rank_order)], b[min(b, key=rank_order)]
        same_out = sorted({_output(p) for p in a.values()}) == sorted({_output(p) for p in b.values()})
        out.append(StageComparison(stage, "", first_a[0].input_digest == first_b[0].input_digest, same_out, True))
    return out


@dataclass
class Divergence:
    """Where a request first differs from its baseline."""

    stage: str | None  # None: every recorded stage agreed
    ranks: list[str]  # the TP ranks that began the difference there (``ranks.locate``; both ran the same ranks)
    input_differed: bool  # the stage's input already differed: the blame lies upstream of the recorded stages
    origin: _ranks.Origin | None = None  # how it began among the stage's ranks (where it has ranks)


def _has_steps(span: lookup.Span) -> bool:
    return bool(span.attributes.get(conventions.STAGE_STEP_INPUT_DIGESTS))


def _first_step(request: lookup.Span, baseline: lookup.Span) -> int | None:
    """The first of the stage's steps whose input differs, when both spans record their steps' inputs."""
    mine = request.attributes.get(conventions.STAGE_STEP_INPUT_DIGESTS)
    theirs = baseline.attributes.get(conventions.STAGE_STEP_INPUT_DIGESTS)
    if not mine or not theirs:
        return None
    mine, theirs = mine.split(","), theirs.split(",")
    return next(
        (i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
        None if len(mine) == len(theirs) else min(len(mine), len(theirs)),
    )


def first_divergence(comparisons: list[StageComparison]) -> Divergence:
    """The first stage of :func:`compare_stages` whose output differs, at the ranks that began the difference there
    (``ranks.locate``: the rank whose contribution differed first, not the ranks that summed it afterwards)."""
    first = next((c for c in comparisons if not c.output_matches), None)
    if first is None:
        return Divergence(None, [], False)
    origin = _origin(comparisons, first.stage)
    if origin is None:  # one span for the stage, or a rank one side lacks
        differing = [c.rank for c in comparisons if c.stage == first.stage and not c.output_matches and c.rank]
        return Divergence(first.stage, differing, first.present and not first.input_matches)
    return Divergence(first.stage, origin.ranks, origin.how == _ranks.UPSTREAM, origin)


def _origin(comparisons: list[StageComparison], stage: str) -> _ranks.Origin | None:
    """Where the stage's difference began among its ranks (``ranks.locate``); None without ranks on both sides."""
    at = [c for c in comparisons if c.stage == stage]
    compared = [
        _ranks.RankComparison(c.rank, c.input_matches, c.output_matches, c.first_step, c.steps)
        for c in at
        if c.rank and c.present
    ]
    return _ranks.locate(compared) if compared and len(compared) == len(at) else None


def ambiguous(first: Divergence) -> bool:
    """Several ranks' contributions differ from the baseline's: it may carry a masked difference of its own."""
    return first.origin is not None and first.origin.how == _ranks.INPUT and len(first.origin.ranks) > 1


def confirmed(first: Divergence, request: lookup.Trace, references: list[lookup.Trace]) -> Divergence:
    """Where several ranks began the difference against the baseline, the ranks that began it against most of the
    baseline and ``references`` (other requests with the majority output, each compared on its own): a baseline
    agrees with the majority in output, not necessarily in every rank's contribution (a corruption the output
    masked). Unchanged when no rank has a majority."""
    if not ambiguous(first) or not references:
        return first
    origins = [first.origin] + [_origin(compare_stages(request, ref), first.stage) for ref in references]
    kept = _ranks.vote(origins)
    if kept and kept != first.origin.ranks:
        first.origin.ranks = first.ranks = kept
    return first


def _by_stage(passes: dict[tuple[str, str], list[lookup.Span]]) -> dict[str, dict[str, list[lookup.Span]]]:
    out: dict[str, dict[str, list[lookup.Span]]] = {}
    for (stage, rank), spans in passes.items():
        out.setdefault(stage, {})[rank] = spans
    return out


def _output(passes: list[lookup.Span]) -> str:
    return conventions.combined_output(s.output_digest for s in passes)


def stage_differences(
    request: lookup.Trace, baseline: lookup.Trace, stage: str, began: list[str] = ()
) -> list[str] | None:
    """Contrast keys of the attributes that differ between the two requests' first passes of the stage at the
    lowest rank that ``began`` the difference (``ranks.locate``), else its lowest rank; None when the request did
    not run the stage."""
    mine = ranks_of(request, stage)
    if not mine:
        return None
    first = min([r for r in began if r in mine] or mine, key=rank_order)
    return [key for key, _, _ in differences(mine[first], ranks_of(baseline, stage).get(first))]


def rank_settings(request: lookup.Trace, baseline: lookup.Trace, first: Divergence) -> tuple[str, list[str]] | None:
    """(rank, contrast keys) of the settings, not identities, of the rank that began a TP difference by its
    contribution that differ from the baseline's same rank: weighed on that rank's own spans (``causes.OnRank``);
    None where no rank began it so."""
    if first.origin is None or first.origin.how != _ranks.INPUT or not first.stage:
        return None
    mine = ranks_of(request, first.stage)
    began = [r for r in first.ranks if r in mine]
    if not began:
        return None
    keys = [
        k
        for k in stage_differences(request, baseline, first.stage, began) or ()
        if not is_measurement(k) and not conventions.is_identity(k.removeprefix(RESOURCE))
    ]
    return (min(began, key=rank_order), keys) if keys else None


def setting_keys(request: lookup.Trace, baseline: lookup.Trace, stage: str, began: list[str] = ()) -> list[str]:
    """The stage's settings whose values differ between the two requests: what a rollout may have changed."""
    return [key for key in stage_differences(request, baseline, stage, began) or () if not is_measurement(key)]
