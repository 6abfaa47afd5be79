"""A GPU that serves older weights than its fleet: it missed a weight sync.

The step a GPU serves and its fleet's step follow ``conventions`` (the rules the dashboards' board and
alert use): the step of its latest decode span, and the median of the service's *other* GPUs' steps, here
over the ``WINDOW_S`` before the request. Only numeric steps count. A request whose decode ran with a lower step than its fleet's
(with TP ranks, the lowest of its ranks') ran on weights the fleet had left behind. Steps are
settings, compared by identity: 1199 is behind 1200 however close. A step above the fleet's is a
canary ahead of it, not this cause; with fewer than ``MIN_GPUS`` other GPUs there is no fleet to lag.

The cause names the same setting as the attribute detector's ``model.weights.step`` difference and a
lagging rollout of it, so ``causes.merged`` keeps one of them: this one, which says which GPU, how far
behind and since when, unless an expected rollout (a sync still in its wave) explains the request.
"""

from __future__ import annotations

from stagetrace.analysis.causes import Cause, attribute_causes
from stagetrace.analysis.detectors import Case, register
from stagetrace.conventions import GPU_UUID, HOST, IS_STEP_SQL, STEP_SQL, WEIGHTS_STEP, fleet_step_sql, weights_step
from stagetrace.lookup import iso_ns

WINDOW_S = 600  # the other GPUs' decode spans this long before the request tell the step each serves
MIN_GPUS = 2  # other GPUs of the service, at least, for a fleet step
# Above a lagging rollout (0.95): the same lag, with the GPU and its fleet's step as evidence. Below an expected
# rollout (1.0): a GPU still inside a sync's wave is an expected change. Above what the attribute contrast gives
# the same step difference (see ``_score``), so the merged entry for ``model.weights.step`` is this one.
SCORE = 0.97
CEILING = 1.0  # an expected rollout's score: never reached

# Per other GPU of the service in the window: its latest step, and when it first served each step.
STEPS_SQL = f"""
SELECT count(), {fleet_step_sql("Latest")}, groupArray(Latest), groupArray(Firsts)
FROM (
    SELECT Gpu, argMax(Step, Last) AS Latest, groupArray((Step, First)) AS Firsts
    FROM (
        SELECT Attributes['{GPU_UUID}'] AS Gpu, {STEP_SQL} AS Step,
               toUnixTimestamp64Nano(min(Start)) AS First, max(Start) AS Last
        FROM {{db:Identifier}}.stagetrace_stages
        WHERE Stage = 'decode' AND ServiceName = {{service:String}}
          AND Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start <= fromUnixTimestamp64Nano({{t1:Int64}})
          AND Gpu != '' AND NOT has({{own:Array(String)}}, Gpu)
          AND {IS_STEP_SQL}
        GROUP BY Gpu, Step)
    GROUP BY Gpu)
"""


@register
class StaleWeights:
    name = "weights"

    def detect(self, case: Case) -> list[Cause]:
        if case.stage != "decode":
            return []
        ranks = [
            (step, rank, s)
            for rank, s in case.spans.items()
            if (step := weights_step(s.attributes)) is not None and s.attributes.get(GPU_UUID)
        ]
        if not ranks:
            return []
        step, _, span = min(ranks, key=lambda r: r[0])
        own = sorted({s.attributes[GPU_UUID] for s in case.spans.values() if s.attributes.get(GPU_UUID)})
        t1 = case.request.start_ns
        row = case.store.client.query(
            STEPS_SQL,
            parameters={
                "db": case.store.database,
                "service": span.service,
                "own": own,
                "t0": t1 - WINDOW_S * 1_000_000_000,
                "t1": t1,
            },
        ).result_rows[0]
        gpus, fleet_step, latest, firsts = int(row[0]), int(row[1]), [int(x) for x in row[2]], row[3]
        if gpus < MIN_GPUS or step >= fleet_step:
            return []
        since = min(int(first) for per_gpu in firsts for s, first in per_gpu if int(s) == fleet_step)
        evidence = {
            "gpu": span.attributes[GPU_UUID],
            "host": span.resource.get(HOST, ""),
            "fleet_step": fleet_step,
            "steps_behind": fleet_step - step,
            "gpus": gpus,
            "gpus_on_fleet_step": sum(1 for x in latest if x == fleet_step),
            "fleet_step_since": iso_ns(since),
        }
        return [Cause("weights", "decode", WEIGHTS_STEP, str(step), str(fleet_step), _score(case), evidence)]


def _score(case: Case) -> float:
    """``SCORE``, or halfway from the attribute contrast's score for the same step difference to ``CEILING``
    when that is higher (a GPU that served many requests behind: nearly all of them diverged)."""
    same = [
        c.score
        for c in attribute_causes(case.stage, case.span, case.baseline_span, case.contrast)
        if c.name == WEIGHTS_STEP and not c.weak
    ]
    return max([SCORE, *((s + CEILING) / 2 for s in same if s < CEILING)])
