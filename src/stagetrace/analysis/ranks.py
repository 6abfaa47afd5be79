"""Which TP rank began a difference: the rank whose input to a stage first differed, not every rank that received it.

In tensor parallelism a collective sums every rank's contribution and leaves the sum on all of them, so one
rank's wrong contribution (a faulty GPU computing with a corrupted shard) makes every rank's output differ. The
outputs cannot tell the ranks apart; the inputs can. Against the baseline's same rank, at the first stage whose
output differs:

- where the ranks record their steps' inputs (``conventions.STAGE_STEP_INPUT_DIGESTS``: one digest per
  collective, in order), the ranks whose input differs at the earliest differing step began it, when other ranks'
  inputs still matched there (later steps take the corrupted sums in on every rank);
- otherwise, the ranks whose input differs while other ranks' inputs match began it (their contribution);
- with every rank's input equal, a rank whose output differs began it inside the stage (the transfer or the
  reduction on its side);
- with every rank's input differing from the start, it began upstream of the stage.

The cause is then weighed on the ranks that began it (their GPU, host, counters and settings), never on the
lowest rank or the root's because they carry the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagetrace import conventions, lookup

INPUT = "input"  # some ranks' contributions differ, others' match
INSIDE = "inside"  # every input matches; some outputs differ
UPSTREAM = "upstream"  # every rank's input differed from the first step on


@dataclass
class RankComparison:
    """One rank of a stage against the baseline's same rank (what ``comparison.compare_stages`` finds)."""

    rank: str
    input_matches: bool
    output_matches: bool
    first_step: int | None  # the first step whose input differs (None: none does, or steps not recorded)
    steps: bool  # both sides recorded their steps' inputs


@dataclass
class Origin:
    """Where a stage's difference began among its ranks."""

    ranks: list[str]  # the ranks that began it
    how: str  # INPUT, INSIDE or UPSTREAM
    received: list[str]  # the ranks whose output differs
    step: int | None = None  # the step at which the beginning ranks' inputs first differed, where recorded
    places: list[dict] = field(default_factory=list)  # per beginning rank: rank, gpu, host (``at``)

    def to_json(self) -> dict:
        return {
            "ranks": self.ranks,
            "how": self.how,
            "received": self.received,
            "step": self.step,
            "places": self.places,
        }


def locate(compared: list[RankComparison]) -> Origin | None:
    """The ranks of one stage that began its difference (module docstring); None when no rank's output differs."""
    received = [c.rank for c in compared if not c.output_matches]
    if not received:
        return None
    if compared and all(c.steps for c in compared):
        earliest = min((c.first_step for c in compared if c.first_step is not None), default=None)
        if earliest is not None:
            began = [c.rank for c in compared if c.first_step == earliest]
            if len(began) < len(compared):
                return Origin(began, INPUT, received, earliest)
            # every rank's input differs at once: from the stage's start on, upstream; later, the step before summed
            # equal contributions into different results
            return Origin(began, UPSTREAM if earliest == 0 else INSIDE, received, earliest)
        return Origin(received, INSIDE, received)
    differing = [c.rank for c in compared if not c.input_matches]
    if differing and len(differing) < len(compared):
        return Origin(differing, INPUT, received)
    if differing:
        return Origin(received, UPSTREAM, received)
    return Origin(received, INSIDE, received)


def vote(origins: list[Origin | None]) -> list[str]:
    """The ranks that began the difference against most of the references (the baseline and other requests with the
    majority output), each compared on its own; ``[]`` when none did."""
    counts: dict[str, int] = {}
    for origin in origins:
        for rank in origin.ranks if origin is not None and origin.how == INPUT else ():
            counts[rank] = counts.get(rank, 0) + 1
    return sorted((r for r, n in counts.items() if 2 * n > len(origins)), key=conventions.rank_order)


def at(origin: Origin, trace: lookup.Trace, stage: str, baseline: lookup.Trace | None = None) -> Origin:
    """The origin with the GPU and host of each beginning rank's place in ``trace``: its first span of the stage whose
    output is none of the baseline's same rank's outputs there, where the difference showed first among the stage's
    spans (a KV transfer's receiving end, when what its sending end sent agreed); else its first span of the stage.
    A span without an output digest shows nothing. The SQL twin is ``population``'s ``BeganSpan``."""
    theirs: dict[str, set[str]] = {}
    for span in baseline.spans if baseline is not None else ():
        if span.stage == stage:
            theirs.setdefault(span.rank, set()).add(span.output_digest)
    first: dict[str, lookup.Span] = {}
    shown: dict[str, lookup.Span] = {}
    for span in sorted((s for s in trace.spans if s.stage == stage and s.rank in origin.ranks), key=_started):
        first.setdefault(span.rank, span)
        if span.output_digest and span.rank in theirs and span.output_digest not in theirs[span.rank]:
            shown.setdefault(span.rank, span)
    places = {rank: shown.get(rank, span) for rank, span in first.items()}
    origin.places = [
        {"rank": rank, "gpu": gpu_of(places[rank]), "host": places[rank].resource.get(conventions.HOST, "")}
        for rank in origin.ranks
        if rank in places
    ]
    return origin


def _started(span: lookup.Span) -> int:
    return span.start_ns


def gpu_of(span: lookup.Span) -> str:
    """The GPU a span ran on: its own ``gpu.uuid``, else its process's, else the one GPU its process could see (the
    resource detector's ``gpu.uuids``: a rank process pinned to its GPU)."""
    visible = span.resource.get(conventions.CONFIGURATION_GPU_UUIDS, "")
    return (
        span.attributes.get(conventions.GPU_UUID)
        or span.resource.get(conventions.GPU_UUID)
        or ("" if "," in visible else visible.strip())
    )


def _ranks(ranks: list[str]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} " + (
        ", ".join(ranks[:-1]) + " and " + ranks[-1] if len(ranks) > 1 else ranks[0]
    )


def where(origin: Origin) -> str:
    """``rank 1 (GPU-..., node-b)``: the beginning ranks with their GPU and host, where known."""
    if not origin.places:
        return _ranks(origin.ranks)
    parts = []
    for place in origin.places:
        known = ", ".join(x for x in (place["gpu"], place["host"]) if x)
        parts.append(f"rank {place['rank']}" + (f" ({known})" if known else ""))
    return ", ".join(parts)


def describe(origin: Origin, stage: str) -> str:
    """The origin in words, e.g. "rank 1's contribution to the all-reduce differs (its input), ranks 0 and 1 both
    received the difference"; ``""`` for UPSTREAM (the verdict says the stage's input already differed)."""
    if origin.how == UPSTREAM or not origin.ranks:
        return ""
    one = len(origin.ranks) == 1
    if origin.how == INPUT:
        what = "contribution to the all-reduce" if stage == "allreduce" else f"input to {stage}"
        step = f", first at step {origin.step + 1}" if origin.step else ""
        head = (
            f"{_ranks(origin.ranks)}'s {what} differs (its input{step})"
            if one
            else f"the {what.replace('contribution', 'contributions')} of {_ranks(origin.ranks)} differ "
            f"(their inputs{step})"
        )
    else:
        head = f"every rank's input to {stage} matches; it began inside {stage} on {_ranks(origin.ranks)}"
    received = origin.received
    if received == origin.ranks and (origin.how == INSIDE or one):
        return head + ("" if origin.how == INSIDE else f", only {_ranks(received)} received the difference")
    both = "both " if len(received) == 2 else "all " if len(received) > 2 else ""
    return f"{head}, {_ranks(received)} {both}received the difference"
