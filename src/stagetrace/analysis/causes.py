"""Ranking the causes of a divergence: attribute differences weighed by contrast, and hardware that rose.

Attribute causes are generic over names: every attribute of the divergent stage (and of its
resource) whose value differs from the baseline's is a candidate. Its score is how much more often
requests whose span carried the request's value diverged first at this stage than requests that
carried the baseline's value, over the requests around it (contrast mining; the request itself is
left out of its own evidence). Numbers are compared by power-of-two bucket, so 24 and 28 count as
the same value but 5 and 24 do not. Attributes that measure what happened rather than set it up
(durations, token counts, ``context.truncated``, ``cache.hit``) are symptoms: they rank after
the settings and hardware with evidence, so the setting behind them is reported first. Hardware causes score their severity when the counter
rose for the request's device and not for the baseline's, a fifth of it when it rose for both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from stagetrace import conventions
from stagetrace.analysis.hardware import Rise
from stagetrace.lookup import Span

UNSCORED = 0.1  # an attribute difference with no population to weigh it against
RESOURCE = "resource:"  # contrast keys of resource attributes
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")
BOTH_ROSE_WEIGHT = 0.2
SMOOTHING = 1.0


@dataclass
class Cause:
    kind: str  # "attribute" | "hardware"
    stage: str
    name: str
    value: str
    baseline_value: str
    score: float
    evidence: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "stage": self.stage, "name": self.name, "value": self.value,
                "baseline_value": self.baseline_value, "score": round(self.score, 4), **self.evidence}  # fmt: skip


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


# Measurements are what a stage did (effects, symptoms); the conventions say which attributes are measurements.
is_symptom = conventions.is_measurement


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


class Contrast:
    """Per (key, bucketed value) of a stage's spans around a request: how many, and how many diverged first there."""

    def __init__(self, counts: dict[tuple[str, str], tuple[int, int]], spans: int, diverged: int):
        self.counts = counts
        self.prior = diverged / spans if spans else 0.0

    def rate(self, key: str, value: str, counted_as_diverged: bool) -> tuple[float, int, int]:
        """(smoothed divergence rate, requests, diverged) among the others whose span had this value."""
        n, d = self.counts.get((key, bucket(value)), (0, 0))
        n, d = max(n - 1, 0), max(d - (1 if counted_as_diverged else 0), 0)  # leave the request itself out
        return (d + SMOOTHING * self.prior) / (n + SMOOTHING), n, d


def attribute_causes(stage: str, request: Span, baseline: Span | None, contrast: Contrast | None) -> list[Cause]:
    causes = []
    for key, value, baseline_value in differences(request, baseline):
        name = key.removeprefix(RESOURCE)
        evidence: dict = {}
        if contrast is None or not contrast.counts:
            score = UNSCORED
        else:
            rate, n, d = contrast.rate(key, value, counted_as_diverged=True)
            baseline_rate, bn, bd = contrast.rate(key, baseline_value, counted_as_diverged=False)
            score = rate - baseline_rate
            evidence = {"diverged_with_value": d, "requests_with_value": n,
                        "diverged_with_baseline_value": bd, "requests_with_baseline_value": bn}  # fmt: skip
        if key.startswith(RESOURCE):
            evidence["resource"] = True
        causes.append(Cause("attribute", stage, name, value, baseline_value, score, evidence))
    return causes


def hardware_causes(stage: str, host: str, rises: list[Rise], baseline_rises: list[Rise], window: tuple[int, int] | None) -> list[Cause]:
    def kind(rise: Rise) -> tuple:
        return rise.metric, tuple(sorted((k, v) for k, v in rise.labels.items() if k not in ("uuid", "device", "gpu", "port", "model")))

    baseline_delta: dict[tuple, float] = {}
    for rise in baseline_rises:
        baseline_delta[kind(rise)] = baseline_delta.get(kind(rise), 0.0) + rise.delta
    causes = []
    for rise in rises:
        before = baseline_delta.get(kind(rise), 0.0)
        score = rise.signal.severity * (BOTH_ROSE_WEIGHT if before > 0 else 1.0)
        evidence = {"host": host, "device": rise.device, "labels": rise.labels}
        if window:
            evidence["window_ns"] = list(window)
        causes.append(Cause("hardware", stage, rise.metric, f"+{rise.delta:g}", f"+{before:g}", score, evidence))
    return causes


def ranked(causes: list[Cause]) -> list[Cause]:
    """Best first: hardware and settings with evidence, then symptoms with evidence, then the rest.

    A symptom (``context.truncated``) is usually the sharper predictor, but it is what the setting
    behind it (``context.max_tokens``) did; when both differ, the setting is the cause to report.
    """

    def tier(c: Cause) -> int:
        if c.score <= 0:
            return 2
        return 1 if c.kind == "attribute" and is_symptom(c.name) else 0

    return sorted(causes, key=lambda c: (tier(c), -c.score, c.kind != "hardware", c.name))
