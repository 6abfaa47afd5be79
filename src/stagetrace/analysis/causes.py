"""Candidate causes and how they are weighed: attribute contrast, identity before magnitude, ranking.

A :class:`Cause` is what a detector (``analysis.detectors``) proposes: a changed setting, a counter
that rose, a rollout, sampling that differs by design. Attribute differences are weighed by
contrast over the requests around the one explained: how much more often requests whose span
carried the request's value diverged first at this stage than those that carried the baseline's
value (the request itself is left out of its own evidence).

Roles decide how a value is compared (``conventions``): a setting by identity, so weight step 1199
is not step 1200 however close; a measurement by its power-of-two magnitude, and only as supporting
evidence, because a duration or a token count is what the stage did, not why. Content, digests and
declared identifiers are never candidates, and an attribute nobody declared whose value is unique to
nearly every request around it is taken for an identifier. A numeric setting whose exact value is
too rare to weigh borrows the evidence of its magnitude (batch size 24 among 16..31) unless the two
values share it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from stagetrace import conventions
from stagetrace.lookup import Span

UNSCORED = 0.1  # an attribute difference with no population to weigh it against
RESOURCE = "resource:"  # contrast keys of resource attributes
SMOOTHING = 1.0
MIN_SUPPORT = 3  # other requests with a value before its own divergence rate counts
IDENTIFIER_SHARE = 0.9  # distinct values per span above which an undeclared attribute is an identifier...
IDENTIFIER_SPANS = 10  # ...among at least this many spans
LIFT = 2.0  # how many times more often others with a value must diverge than with the baseline's, to count
# A setting whose score is within this of an identity's separates the requests as well: it ranks first (why), and the
# identity is named as where. Two settings within it that split the same requests changed together.
TIE = 0.05
SCORE_DIGITS = 4  # a score as recorded: its JSON, and the order the tables show
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")


@dataclass
class Cause:
    kind: str  # "attribute" | "hardware" | "rollout" | "nondeterminism"
    stage: str
    name: str
    value: str
    baseline_value: str
    score: float
    evidence: dict = field(default_factory=dict)
    weak: bool = False  # supporting evidence only: a measurement, a signal that rose for both, contradicted

    @property
    def recorded_score(self) -> float:
        """The score as its JSON records it: the tables rank and show this one, from a cause or its JSON alike."""
        return round(self.score, SCORE_DIGITS)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "stage": self.stage,
            "name": self.name,
            "value": self.value,
            "baseline_value": self.baseline_value,
            "score": self.recorded_score,
            "weak": self.weak,
            **self.evidence,
        }

    @classmethod
    def from_json(cls, data: dict) -> Cause:
        """A cause from its JSON (:meth:`to_json`): its fields, and the rest its evidence."""
        return cls(
            data.get("kind", ""),
            data.get("stage", ""),
            data.get("name", ""),
            data.get("value", ""),
            data.get("baseline_value", ""),
            data.get("score", 0.0),
            {k: v for k, v in data.items() if k not in _FIELDS},
            data.get("weak", False),
        )


_FIELDS = ("kind", "stage", "name", "value", "baseline_value", "score", "weak")  # the rest of a cause's JSON: evidence


def bucket(value: str) -> str:
    """A number's sign and power of two (``2^4`` for 16..31); anything else unchanged. Same as ``BUCKET_SQL``."""
    if not _NUMBER.fullmatch(value):
        return value
    number = float(value)
    if number == 0 or not math.isfinite(number):
        return value
    return f"{'-' if number < 0 else ''}2^{math.floor(math.log2(abs(number)))}"


BUCKET_SQL = (
    "if(match({v}, '^-?[0-9]+(\\\\.[0-9]+)?([eE][-+]?[0-9]+)?$') AND toFloat64({v}) != 0"
    " AND isFinite(toFloat64({v})), concat(if(toFloat64({v}) < 0, '-', ''), '2^',"
    " toString(toInt32(floor(log2(abs(toFloat64({v}))))))), {v})"
)


def is_measurement(key: str) -> bool:
    return conventions.is_measurement(key.removeprefix(RESOURCE))


def differences(request: Span, baseline: Span | None) -> list[tuple[str, str, str]]:
    """``(contrast key, value, baseline value)`` for every attribute of the span or its resource that differs."""
    base_attrs = baseline.attributes if baseline else {}
    base_resource = baseline.resource if baseline else {}
    out = []
    for prefix, mine, theirs in (("", request.attributes, base_attrs), (RESOURCE, request.resource, base_resource)):
        for name in sorted(set(mine) | set(theirs)):
            if conventions.is_comparable(name) and mine.get(name, "") != theirs.get(name, ""):
                out.append((prefix + name, mine.get(name, ""), theirs.get(name, "")))
    return out


def suspect(n: int, d: int, spans: int, diverged: int) -> bool:
    """Whether a recorded value explains its spans' divergences (several faults at once): at least ``MIN_SUPPORT`` of
    its ``n`` spans diverged (``d``), at least ``LIFT`` times as often as the rest of the stage's ``spans`` among the
    same peers (``diverged`` of them in all)."""
    return d >= MIN_SUPPORT and spans > n and d * (spans - n) >= LIFT * (diverged - d) * n


class Contrast:
    """Per (key, value) of a stage's spans around a request: how many, and how many diverged first there.

    Settings are counted by value, measurements by bucket (``population.contrast`` groups them so).
    ``identifiers`` are the keys whose values were unique to nearly every span: not counted at all.
    ``explained``: per (key, value), how many of its diverged spans another key's suspect value explains (several
    faults at once); the baseline's value is weighed without them.
    """

    def __init__(
        self,
        counts: dict[tuple[str, str], tuple[int, int]],
        spans: int,
        diverged: int,
        identifiers: frozenset[str] = frozenset(),
        explained: dict[tuple[str, str], int] | None = None,
    ):
        self.counts = counts
        self.explained = explained or {}
        self.prior = diverged / spans if spans else 0.0
        self.identifiers = identifiers
        self._buckets: dict[tuple[str, str], tuple[int, int]] = {}
        for (key, value), (n, d) in counts.items():
            b = self._buckets.get((key, bucket(value)), (0, 0))
            self._buckets[(key, bucket(value))] = (b[0] + n, b[1] + d)

    def rate(
        self, key: str, value: str, counted_as_diverged: bool, by_bucket: bool = False, explaining_away: bool = False
    ) -> tuple[float, int, int]:
        """(smoothed divergence rate, requests, diverged) among the others whose span had this value (or bucket);
        ``explaining_away``: without the diverged spans another cause explains (for the baseline's value: a cause
        is weighed against the requests it could explain, not against another fault's)."""
        if by_bucket or is_measurement(key):
            n, d = self._buckets.get((key, bucket(value)), (0, 0))
        else:
            n, d = self.counts.get((key, value), (0, 0))
            if explaining_away:
                x = self.explained.get((key, value), 0)
                n, d = n - x, d - x
        n, d = max(n - 1, 0), max(d - (1 if counted_as_diverged else 0), 0)  # leave the request itself out
        return (d + SMOOTHING * self.prior) / (n + SMOOTHING), n, d


class OnRank:
    """The contrast of a stage whose difference a TP rank began by its contribution (``analysis.ranks``): that rank's
    settings weighed on its own spans (``rank``: ``population.rank_contrasts``, a span diverged where its rank began a
    difference), everything else (identities, measurements) by the ``stage``'s contrast as before. The stage's alone
    cannot weigh them: it judges a span among spans with the same stage input, and the beginning rank's input is its
    own."""

    def __init__(self, stage: Contrast | None, rank: Contrast, name: str):
        self.stage, self.rank, self.name = stage or Contrast({}, 0, 0), rank, name
        self.counts = self.stage.counts or rank.counts
        self.identifiers = self.stage.identifiers

    def weighs(self, key: str) -> bool:
        """Whether the key is weighed on the rank's own spans."""
        return any(k == key for k, _ in self.rank.counts)

    def rate(
        self, key: str, value: str, counted_as_diverged: bool, by_bucket: bool = False, explaining_away: bool = False
    ) -> tuple[float, int, int]:
        return (self.rank if self.weighs(key) else self.stage).rate(
            key, value, counted_as_diverged, by_bucket, explaining_away
        )


def attribute_causes(
    stage: str, request: Span, baseline: Span | None, contrast: Contrast | OnRank | None
) -> list[Cause]:
    """Every setting (and, as weak evidence, measurement) of the span that differs from the baseline's. A setting
    weighed on the rank that began the difference (``OnRank``) says so, with that rank's host as where it ran."""
    causes = []
    for key, value, baseline_value in differences(request, baseline):
        if contrast is not None and key in contrast.identifiers:
            continue
        name = key.removeprefix(RESOURCE)
        measurement = is_measurement(key)
        evidence: dict = {"role": "measurement" if measurement else "setting"}
        if contrast is None or not contrast.counts:
            score, weak = UNSCORED, measurement
        else:
            rate, n, d = contrast.rate(key, value, counted_as_diverged=True)
            baseline_rate, bn, bd = contrast.rate(key, baseline_value, counted_as_diverged=False, explaining_away=True)
            if (
                not measurement
                and n < MIN_SUPPORT
                and _NUMBER.fullmatch(value)
                and _NUMBER.fullmatch(baseline_value)
                and bucket(value) != bucket(baseline_value)
            ):
                rate, n, d = contrast.rate(key, value, counted_as_diverged=True, by_bucket=True)
                baseline_rate, bn, bd = contrast.rate(key, baseline_value, counted_as_diverged=False, by_bucket=True)
                evidence["compared"] = "magnitude"
            score = rate - baseline_rate
            # others with the value diverged hardly more often than those with the baseline's: it does not explain it
            weak = measurement or (n >= MIN_SUPPORT and rate < LIFT * baseline_rate)
            if n == bn == 0:  # no other request carried either value: nothing to weigh it by
                score, weak = UNSCORED, True
            evidence.update(
                {
                    "diverged_with_value": d,
                    "requests_with_value": n,
                    "diverged_with_baseline_value": bd,
                    "requests_with_baseline_value": bn,
                }
            )
        if key.startswith(RESOURCE):
            evidence["resource"] = True
        if isinstance(contrast, OnRank) and contrast.weighs(key):
            evidence["weighed_on_rank"] = contrast.name
            if request.resource.get(conventions.HOST):
                evidence["where"] = {conventions.HOST: request.resource[conventions.HOST]}
        neutral = conventions.NUMERICS_NEUTRAL.get(name)
        if neutral:  # documented not to change what is computed: named, never blamed
            evidence["neutral"] = neutral
            weak = True
        causes.append(Cause("attribute", stage, name, value, baseline_value, score, evidence, weak))
    return causes


def merged(causes: list[Cause]) -> list[Cause]:
    """One entry per (kind family, stage, name, device): two detectors naming the same setting keep the stronger."""
    best: dict[tuple, Cause] = {}
    for cause in causes:
        key = (
            cause.kind == "hardware",
            cause.stage,
            cause.name,
            cause.evidence.get("device"),
            cause.evidence.get("rank"),
        )
        kept = best.get(key)
        if kept is None or (kept.weak, -kept.score) > (cause.weak, -cause.score):
            best[key] = cause
    return list(best.values())


def _is_identity(cause: Cause) -> bool:
    return cause.kind == "attribute" and conventions.is_identity(cause.name)


def _is_setting(cause: Cause) -> bool:
    return (
        cause.kind == "attribute"
        and not cause.weak
        and not conventions.is_identity(cause.name)
        and cause.evidence.get("role") == "setting"
    )


def _weighed(cause: Cause) -> bool:
    """Whether a contrast weighed the cause (counts of requests with each value), not only found it differing."""
    return cause.evidence.get("requests_with_value") is not None


def _split(cause: Cause) -> tuple:
    """Which requests the cause separates: the counts its contrast found."""
    ev = cause.evidence
    return (
        ev.get("diverged_with_value"),
        ev.get("requests_with_value"),
        ev.get("diverged_with_baseline_value"),
        ev.get("requests_with_baseline_value"),
    )


def ranked(causes: list[Cause]) -> list[Cause]:
    """The candidates with support, strong before weak, each by score; zero and negative scores are no evidence.

    An identity (host, pod, GPU UUID...) ranks after a setting that separates the requests as well (within ``TIE``):
    the setting is why, and the identities are recorded on it as where (``evidence["where"]``). Settings that split
    the same requests equally well changed together: the first names the others (``evidence["together"]``)."""
    # a score that rounds to nothing in the report (the smoothing's prior alone, neither value ever diverged) is none
    kept = [c for c in merged(causes) if round(c.score, 4) > 0]
    # only what a contrast weighed separates requests: unweighed differences say nothing of where or together
    best_setting = max((c.score for c in kept if _is_setting(c) and _weighed(c)), default=None)

    def order(c: Cause):
        demoted = (
            _is_identity(c)
            and not c.weak
            and _weighed(c)
            and best_setting is not None
            and best_setting >= c.score - TIE
        )
        # a demoted identity follows the settings that separate as well as it, and precedes those that do not
        return (c.weak, -(c.score - TIE) if demoted else -c.score, demoted, c.kind != "hardware", c.name)

    out = sorted(kept, key=order)
    top = next((c for c in out if not c.weak), None)
    if top is not None and _is_setting(top) and _weighed(top):
        where = {c.name: c.value for c in out if _is_identity(c) and not c.weak and c.score >= top.score - TIE}
        together = [
            {"name": c.name, "value": c.value, "baseline_value": c.baseline_value}
            for c in out
            if c is not top and _is_setting(c) and abs(c.score - top.score) <= TIE and _split(c) == _split(top)
        ]
        if where:
            top.evidence["where"] = where
        if together:
            top.evidence["together"] = together
    return out
