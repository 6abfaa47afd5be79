"""Sampling that differs by design: above temperature zero without a seed, or declared nondeterministic.

The request's own spans say so (``conventions.nondeterminism``); such a request's output is not
expected to agree with any other, so the verdict says why instead of blaming whatever else differs.
"""

from __future__ import annotations

from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register

SCORE = 1.0


@register
class Nondeterminism:
    name = "nondeterminism"

    def detect(self, case: Case) -> list[Cause]:
        if not case.nondeterminism:
            return []
        name = case.nondeterminism.split(" ", 1)[0]
        return [
            Cause("nondeterminism", case.stage, name, case.nondeterminism, "", SCORE, {"reason": case.nondeterminism})
        ]
