"""Suspected silent data corruption: one GPU that began the difference of many requests, with nothing recorded
against it.

About one accelerator in a thousand returns wrong numbers with no error (Meta's and Google's fleet counts). When a
TP stage's difference began on one rank (``analysis.ranks``) and no detector found a cause (no error counter rose on
its GPU or NIC, no setting of its differs), the GPU is a suspect; when the same GPU began the differences of
``MIN_REQUESTS`` requests or more, the verdict says so plainly, with its UUID and host. The other requests are those
the analyser recorded in ``stagetrace_divergences`` (its ``Devices`` hold the GPUs of the ranks that began each one)
with no cause either, counted in one query over that small table: never a query per request.
"""

from __future__ import annotations

from stagetrace.analysis import ranks
from stagetrace.analysis.causes import Cause
from stagetrace.store import Store

MIN_REQUESTS = 3  # requests a GPU began with nothing recorded against it, at least, to suspect it
KIND = "sdc"
NAME = "silent_data_corruption"
SCORE = 0.9
UNEXPLAINED = ("", KIND)  # top causes of a recorded deviation that leave its GPU unexplained

# per GPU among ``gpus``: the requests recorded in [t0, t1) whose difference began on it with no cause found
BEGAN_SQL = """
SELECT Gpu, groupUniqArray(RequestId)
FROM (SELECT RequestId, arrayJoin(splitByChar(',', Devices)) AS Gpu
      FROM {db:Identifier}.stagetrace_divergences FINAL
      WHERE RequestStart >= fromUnixTimestamp64Nano({t0:Int64}) AND RequestStart < fromUnixTimestamp64Nano({t1:Int64})
        AND TopCauseKind IN {unexplained:Array(String)} AND hasAny(splitByChar(',', Devices), {gpus:Array(String)}))
WHERE Gpu IN {gpus:Array(String)}
GROUP BY Gpu"""


def gpus(origin: ranks.Origin | None) -> list[str]:
    """The GPUs of the ranks that began a difference inside a TP stage or by their contribution (not upstream)."""
    if origin is None or origin.how == ranks.UPSTREAM:
        return []
    return sorted({p["gpu"] for p in origin.places if p["gpu"]})


def recorded(store: Store, gpu_uuids, t0_ns: int, t1_ns: int) -> dict[str, set[str]]:
    """GPU → the request IDs recorded in [t0, t1) whose difference began on it with no cause found."""
    gpu_uuids = sorted(set(gpu_uuids))
    if not gpu_uuids:
        return {}
    rows = store.client.query(
        BEGAN_SQL,
        parameters={
            "db": store.database,
            "t0": t0_ns,
            "t1": t1_ns,
            "unexplained": list(UNEXPLAINED),
            "gpus": gpu_uuids,
        },
    ).result_rows
    return {gpu: set(ids) for gpu, ids in rows}


def suspected(
    causes: list[Cause], stage: str, origin: ranks.Origin | None, began: dict[str, set[str]], request_id: str
) -> list[Cause]:
    """The causes, led by a suspected silent data corruption when nothing strong explains the request and a GPU that
    began it began ``MIN_REQUESTS`` or more (``began``: GPU → request IDs, this one counted too)."""
    if any(not c.weak for c in causes):
        return causes
    for place in origin.places if origin is not None and origin.how != ranks.UPSTREAM else ():
        requests = began.get(place["gpu"], set()) | {request_id}
        if place["gpu"] and len(requests) >= MIN_REQUESTS:
            evidence = {
                "gpu": place["gpu"],
                "host": place["host"],
                "rank": place["rank"],
                "device": place["gpu"],
                "requests": len(requests),
                "began": origin.how,
            }
            return [Cause(KIND, stage, NAME, place["gpu"], "", SCORE, evidence), *causes]
    return causes
