"""Rollouts: a setting that changed on most hosts and stayed (``analysis.rollouts``).

A request with the new value, compared with a baseline that still had the old one, is the rollout
itself: an expected change. A request with the old value during the wave is the rollout still
reaching its host, also expected; with the old value well after the wave, its host lags the fleet,
and the setting is the cause.
"""

from __future__ import annotations

from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register
from stagetrace.analysis.rollouts import value_of

EXPECTED_SCORE = 1.0
LAGGING_SCORE = 0.95


@register
class Rollout:
    name = "rollout"

    def detect(self, case: Case) -> list[Cause]:
        theirs = case.baseline_span
        if theirs is None:
            return []
        causes = []
        for rollout in case.rollouts:
            if rollout.stage != case.stage or rollout.service != case.span.service:  # another service's is no move here
                continue
            mine, base = value_of(case.span, rollout.key), value_of(theirs, rollout.key)
            verdict = rollout.explains(mine, base, case.span.start_ns)
            if verdict is None:
                continue
            host = case.span.resource.get("host.name", "")
            evidence = {"rollout": rollout.to_json(), "expected": verdict == "expected", "host": host}
            score = EXPECTED_SCORE if verdict == "expected" else LAGGING_SCORE
            causes.append(Cause("rollout", case.stage, rollout.name, mine, base, score, evidence))
        return causes
