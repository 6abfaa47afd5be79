"""The divergence analysis' results as data, apart from how they are shown or stored.

``divergences.compute`` returns a :class:`DivergenceReport`: the deviating requests analysed in full (each a
:class:`DeviatingRequest`, grouped by input in :class:`InputGroup`), the rollouts found and the tally. Its readers
take fields, never keys: the live analyser counts the requests by their stage, top cause and the ranks that began
them; ``divergences.record`` stores one ``stagetrace_divergences`` row per request (:meth:`DeviatingRequest.row`);
``stagetrace divergences`` shows its fields (``render.divergence_groups``) and
``stagetrace divergences --json`` prints :meth:`DivergenceReport.to_json`.

``Explainer.explain`` returns an :class:`Explanation`: one request against its :class:`Baseline`, its stages and ranked
causes. ``render`` and ``report`` read its fields; ``stagetrace explain --json`` prints :meth:`Explanation.to_json`,
and :meth:`Explanation.from_json` reads such a report back for showing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stagetrace import lookup
from stagetrace.analysis import ranks
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.comparison import StageComparison

if TYPE_CHECKING:
    from stagetrace.analysis.rollouts import Rollout

# stagetrace_divergences' columns, in the order of :meth:`DeviatingRequest.row`
COLUMNS = (
    "DetectedAt",
    "RequestId",
    "TraceId",
    "RequestStart",
    "ServiceName",
    "HostName",
    "InputDigest",
    "BaselineRequestId",
    "BaselineHow",
    "FirstDivergentStage",
    "TopCauseKind",
    "TopCauseName",
    "TopCauseValue",
    "TopCauseBaselineValue",
    "TopCauseScore",
    "Causes",
    "Summary",
    "Devices",
    "BeganRank",
    "BeganGpu",
    "BeganHost",
)
KEPT_CAUSES = 5  # the causes a stored row keeps, strongest first


@dataclass
class Baseline:
    """The request a request is compared with, and how it was chosen."""

    request_id: str
    how: str  # "explicit" | "majority" | "nearest_earlier"
    support: int  # requests with the baseline's output
    group_size: int  # requests with the request's input
    trace: lookup.Trace | None = None

    def describe(self) -> str:
        if self.how == "majority":
            return f"baseline: request {self.request_id}, {self.support} of {self.group_size} requests"
        if self.how == "explicit":
            return f"baseline: request {self.request_id}"
        return f"baseline: the nearest earlier request {self.request_id}"

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "how": self.how, "support": self.support, "group_size": self.group_size}

    @classmethod
    def from_json(cls, data: dict) -> Baseline:
        return cls(data.get("request_id", ""), data["how"], data.get("support", 1), data.get("group_size", 1))


def began_places(origin: ranks.Origin | None) -> list[tuple[str, str, str]]:
    """(rank, GPU, host) of each TP rank that began a difference, by its contribution or inside the stage; none where
    no rank began it (a stage without ranks, or a difference from upstream)."""
    if origin is None or origin.how == ranks.UPSTREAM or not origin.places:
        return []
    return [(place["rank"], place["gpu"], place["host"]) for place in origin.places]


def began_columns(origin: ranks.Origin | None) -> tuple[str, str, str]:
    """``BeganRank``, ``BeganGpu`` and ``BeganHost`` of a stored divergence: the TP ranks that began it by their
    contribution or inside the stage, with each one's GPU and host, comma-separated in the same order (so that the
    dashboards pair them); empty where no rank began it (a stage without ranks, or a difference from upstream). The
    request's own host stays in ``HostName``."""
    places = began_places(origin)
    if not places:
        return "", "", ""
    return tuple(",".join(column) for column in zip(*places))


@dataclass
class DeviatingRequest:
    """One deviating request analysed in full: where it first differs from its baseline, and why."""

    request_id: str
    trace_id: str
    service: str
    host: str
    start_ns: int
    input_digest: str
    baseline: Baseline
    stage: str | None  # its first divergent stage; None where its or its baseline's spans are gone
    origin: ranks.Origin | None  # the TP ranks that began the difference, where the stage has ranks
    causes: list[Cause]  # ranked, strongest first
    summary: str  # the verdict in one line
    device: str  # the GPUs (else the NICs) the stage ran on, comma-separated
    seed_unknown: str = ""  # why it samples with a seed nobody recorded, or ""

    @property
    def top(self) -> Cause | None:
        """The strongest cause that is not weak, if any."""
        return next((c for c in self.causes if not c.weak), None)

    def began(self) -> list[tuple[str, str, str]]:
        """(rank, GPU, host) of each TP rank that began its difference (:func:`began_places`)."""
        return began_places(self.origin)

    def to_json(self) -> dict:
        top = self.top
        began_rank, began_gpu, began_host = began_columns(self.origin)
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "service": self.service,
            "baseline_request_id": self.baseline.request_id,
            "start": lookup.iso_ns(self.start_ns),
            "host": self.host,
            "device": self.device,
            "began": self.origin.places if self.origin else [],
            "began_rank": began_rank,
            "began_gpu": began_gpu,
            "began_host": began_host,
            "first_divergent_stage": self.stage,
            "top_cause": top.to_json() if top else None,
            "summary": self.summary,
            "seed_unknown": self.seed_unknown or None,
        }

    def row(self, detected_ms: int) -> tuple:
        """Its ``stagetrace_divergences`` row (``COLUMNS``), detected at ``detected_ms``."""
        top = self.top
        return (
            detected_ms,
            self.request_id,
            self.trace_id,
            self.start_ns,
            self.service,
            self.host,
            self.input_digest,
            self.baseline.request_id,
            self.baseline.how,
            self.stage or "",
            top.kind if top else "",
            top.name if top else "",
            top.value if top else "",
            top.baseline_value if top else "",
            top.score if top else 0.0,
            json.dumps([c.to_json() for c in self.causes[:KEPT_CAUSES]]),
            self.summary,
            self.device,
            *began_columns(self.origin),
        )


@dataclass
class InputGroup:
    """The requests of one input: how many, the majority's output and its support, and the deviating ones analysed."""

    input_digest: str
    requests: int
    majority_output: str
    support: int
    deviating: list[DeviatingRequest] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "input_digest": self.input_digest,
            "requests": self.requests,
            "majority_output": self.majority_output,
            "support": self.support,
            "deviating": [d.to_json() for d in self.deviating],
        }


@dataclass
class TallyLine:
    """The deviating requests of one cause, first divergent stage and service (``divergences.tally``)."""

    cause: str  # the top cause's name (the setting the contrast ranks first, for those not analysed); "": none
    stage: str  # the first divergent stage; "": after the last stage
    service: str
    requests: int
    analysed: int  # of them, those analysed in full
    hosts: list[str]
    first_seen: str  # RFC 3339, as ``lookup.iso_ns``
    last_seen: str
    began_on: dict[str, int] = field(default_factory=dict)  # ``GPU (host)`` of the rank that began them → requests

    def to_json(self) -> dict:
        line = {
            "cause": self.cause,
            "stage": self.stage,
            "service": self.service,
            "requests": self.requests,
            "analysed": self.analysed,
            "hosts": self.hosts,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }
        if self.began_on:
            line["began_on"] = self.began_on
        return line


@dataclass
class DivergenceReport:
    """What one divergence analysis over a window found (``divergences.compute``)."""

    since_ns: int
    deviating: int  # deviating requests, less those a rollout's wave explains
    analysed_expected: int  # of the latest analysed in full, those a rollout's wave explains
    nondeterministic_by_service: dict[str, int]  # requests that sample without a seed: not compared, counted
    rollouts: list[tuple[Rollout, int]]  # each rollout found, with the requests its wave explains
    tally: list[TallyLine]  # every deviating request by cause and stage, most first (``divergences.tally``)
    tally_covers: str  # "all" or "analysed"
    groups: list[InputGroup]
    requests: list[DeviatingRequest]  # the analysed requests, in the order analysed (each also in its group)
    detected_ms: int  # when the analysis ran: the rows' DetectedAt

    @property
    def analysed(self) -> int:
        return len(self.requests)

    @property
    def nondeterministic(self) -> int:
        return sum(self.nondeterministic_by_service.values())

    @property
    def seed_unknown(self) -> int:
        """Deviating requests that sample with a seed their engine does not record: compared, and said."""
        return sum(1 for g in self.groups for d in g.deviating if d.seed_unknown)

    def rows(self) -> list[tuple]:
        """The ``stagetrace_divergences`` rows, one per analysed request."""
        return [d.row(self.detected_ms) for d in self.requests]

    def to_json(self) -> dict:
        return {
            "since_ns": self.since_ns,
            "deviating": self.deviating,
            "analysed": self.analysed,
            "analysed_expected": self.analysed_expected,
            "nondeterministic": self.nondeterministic,
            "nondeterministic_by_service": self.nondeterministic_by_service,
            "seed_unknown": self.seed_unknown,
            "rollouts": [{**r.to_json(), "requests": n} for r, n in self.rollouts],
            "tally": [t.to_json() for t in self.tally],
            "tally_covers": self.tally_covers,
            "groups": [g.to_json() for g in self.groups],
        }


@dataclass
class Explanation:
    """Why one request's output deviates (``Explainer.explain``): its baseline, first divergent stage and ranked
    causes. ``stages``, ``origin`` and ``stage_input_differed`` are set only where the outputs differ and the stages
    were compared (``stages`` is None elsewhere, and its JSON leaves the three out)."""

    request_id: str
    trace_id: str
    input_digest: str = ""
    output_digest: str = ""
    nondeterministic: bool = False
    nondeterminism: str | None = None  # why it may differ by design
    seed_unknown: str | None = None  # why it samples with a seed nobody recorded
    expected: bool = False  # a rollout explains the difference
    rollouts: list[Rollout] = field(default_factory=list)
    divergent_ranks: list[str] = field(default_factory=list)
    baseline: Baseline | None = None  # None: no other request to compare with
    diverged: bool = False
    first_divergent_stage: str | None = None
    causes: list[Cause] = field(default_factory=list)  # ranked, strongest first
    summary: str = ""  # the verdict in one line
    origin: ranks.Origin | None = None  # the TP ranks that began the difference
    stage_input_differed: bool = False
    stages: list[StageComparison] | None = None

    def to_json(self) -> dict:
        head = {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "input_digest": self.input_digest,
            "output_digest": self.output_digest,
            "nondeterministic": self.nondeterministic,
            "nondeterminism": self.nondeterminism,
            "seed_unknown": self.seed_unknown,
            "expected": self.expected,
            "rollouts": [r.to_json() for r in self.rollouts],
            "divergent_ranks": self.divergent_ranks,
            "baseline": self.baseline.to_json() if self.baseline else None,
            "diverged": self.diverged,
            "first_divergent_stage": self.first_divergent_stage,
        }
        if self.stages is not None:
            head.update(
                {
                    "origin": self.origin.to_json() if self.origin else None,
                    "stage_input_differed": self.stage_input_differed,
                    "stages": [c.to_json() for c in self.stages],
                }
            )
        return {**head, "causes": [c.to_json() for c in self.causes], "summary": self.summary}

    @classmethod
    def from_json(cls, data: dict) -> Explanation:
        """An explanation read back from its JSON, for showing it. The rollouts are left out: their JSON does not
        hold the hosts' switch times, and nothing shown reads them."""
        stages = data.get("stages")
        return cls(
            data["request_id"],
            data["trace_id"],
            data.get("input_digest", ""),
            data.get("output_digest", ""),
            data.get("nondeterministic", False),
            data.get("nondeterminism"),
            data.get("seed_unknown"),
            data.get("expected", False),
            [],
            list(data.get("divergent_ranks") or []),
            Baseline.from_json(data["baseline"]) if data.get("baseline") else None,
            data.get("diverged", False),
            data.get("first_divergent_stage"),
            [Cause.from_json(c) for c in data.get("causes") or ()],
            data.get("summary", ""),
            ranks.Origin(**data["origin"]) if data.get("origin") else None,
            data.get("stage_input_differed", False),
            None if stages is None else [_stage_of(c) for c in stages],
        )


def _stage_of(data: dict) -> StageComparison:
    return StageComparison(
        data["stage"], data.get("rank") or "", data["input_matches"], data["output_matches"], data["present"]
    )


__all__ = [
    "COLUMNS",
    "KEPT_CAUSES",
    "Baseline",
    "DeviatingRequest",
    "DivergenceReport",
    "Explanation",
    "InputGroup",
    "TallyLine",
    "began_columns",
    "began_places",
]
