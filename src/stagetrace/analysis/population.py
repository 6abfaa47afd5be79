"""Who deviates, and where: majority outputs, deviating requests and first divergent stages, computed in ClickHouse.

Requests are grouped by ``InputDigest``; a group's majority output is its most common output when
at least two requests share it and no other output is as common. A request deviates when its
output differs from its group's majority. Its first divergent stage is the first stage, in pipeline
order, whose output digest differs from the one most agreeing requests of its group produced there
(a stage the group ran and the request did not also counts). Grouping, majorities and the stage
comparison run as SQL; only the deviating requests come back.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace.store import Store
from stagetrace.tracing import PIPELINE_STAGES

# Stages outside the pipeline's named five come after them, in the order the group ran them.
_ORDER = "if(indexOf({pipeline:Array(String)}, Stage) = 0, 100, indexOf({pipeline:Array(String)}, Stage))"

# Requests in the window, latest trace per request ID (a retry reuses the ID).
_REQUESTS = """
    SELECT RequestId, argMax(TraceId, S) AS TraceId, argMax(InputDigest, S) AS InputDigest,
           argMax(OutputDigest, S) AS OutputDigest, max(S) AS Start, argMax(HostName, S) AS HostName
    FROM (SELECT RequestId, TraceId, InputDigest, OutputDigest, Start AS S, HostName
          FROM {db:Identifier}.stagetrace_requests
          WHERE Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start < fromUnixTimestamp64Nano({t1:Int64}))
    GROUP BY RequestId
    HAVING InputDigest != ''"""

_MAJORITIES = f"""
    SELECT InputDigest, argMax(OutputDigest, n) AS Majority, max(n) AS Support, sum(n) AS GroupSize
    FROM (SELECT InputDigest, OutputDigest, count() AS n FROM ({_REQUESTS}) GROUP BY InputDigest, OutputDigest)
    GROUP BY InputDigest
    HAVING Support >= 2 AND arrayCount(x -> x = Support, groupArray(n)) = 1"""

_LABELLED = f"""
    SELECT r.RequestId AS RequestId, r.TraceId AS TraceId, r.InputDigest AS InputDigest, r.OutputDigest AS OutputDigest,
           r.Start AS Start, r.HostName AS HostName, m.Majority AS Majority, m.Support AS Support,
           m.GroupSize AS GroupSize, r.OutputDigest = m.Majority AS Agrees
    FROM ({_REQUESTS}) AS r INNER JOIN ({_MAJORITIES}) AS m ON r.InputDigest = m.InputDigest"""

# Stage spans of the labelled requests. Spans may start a little before or after their root (ranks on other hosts).
_STAGES = f"""
    SELECT TraceId, SpanAttributes['stagetrace.stage'] AS Stage, SpanAttributes['parallel.tp_rank'] AS Rank,
           SpanAttributes['stagetrace.stage.input_digest'] AS StageIn, SpanAttributes['stagetrace.stage.output_digest'] AS StageOut,
           toUnixTimestamp64Nano(Timestamp) AS SpanStart
    FROM {{db:Identifier}}.otel_traces
    WHERE Timestamp >= fromUnixTimestamp64Nano({{t0:Int64}} - {{margin:Int64}})
      AND Timestamp < fromUnixTimestamp64Nano({{t1:Int64}} + {{margin:Int64}})
      AND mapContains(SpanAttributes, 'stagetrace.stage')
      AND TraceId IN (SELECT TraceId FROM ({_LABELLED}))"""

DEVIATIONS_SQL = f"""
WITH
    labelled AS ({_LABELLED}),
    stages AS (
        SELECT s.*, l.InputDigest AS InputDigest, l.Agrees AS Agrees, s.SpanStart - toUnixTimestamp64Nano(l.Start) AS Offset
        FROM ({_STAGES}) AS s INNER JOIN labelled AS l ON s.TraceId = l.TraceId),
    expected AS (
        SELECT InputDigest, Stage, Rank, argMax(StageOut, n) AS ExpectedOut, argMax(StageIn, n) AS ExpectedIn,
               min(FirstOffset) AS Offset
        FROM (SELECT InputDigest, Stage, Rank, StageOut, any(StageIn) AS StageIn, count() AS n, min(Offset) AS FirstOffset
              FROM stages WHERE Agrees GROUP BY InputDigest, Stage, Rank, StageOut)
        GROUP BY InputDigest, Stage, Rank),
    compared AS (
        SELECT d.RequestId AS RequestId, e.Stage AS Stage, e.Rank AS Rank, e.Offset AS Offset,
               e.ExpectedOut AS ExpectedOut, e.ExpectedIn AS ExpectedIn, d.TraceId AS TraceId
        FROM (SELECT * FROM labelled WHERE NOT Agrees) AS d INNER JOIN expected AS e ON d.InputDigest = e.InputDigest),
    diverged AS (
        SELECT c.RequestId AS RequestId,
               argMin((c.Stage, c.Rank, s.StageIn != c.ExpectedIn), ({_ORDER.replace('Stage', 'c.Stage')}, c.Offset)) AS First
        FROM compared AS c LEFT JOIN stages AS s ON s.TraceId = c.TraceId AND s.Stage = c.Stage AND s.Rank = c.Rank
        WHERE s.StageOut != c.ExpectedOut OR s.TraceId = ''
        GROUP BY c.RequestId)
SELECT l.RequestId, l.TraceId, l.InputDigest, l.OutputDigest, l.Majority, l.Support, l.GroupSize,
       toUnixTimestamp64Nano(l.Start), l.HostName, d.First.1, d.First.2, d.First.3
FROM labelled AS l LEFT JOIN diverged AS d ON l.RequestId = d.RequestId
WHERE NOT l.Agrees
ORDER BY l.Start
"""

AGREEING_SQL = f"""
SELECT InputDigest, groupArray((RequestId, TraceId, toUnixTimestamp64Nano(Start), HostName))
FROM ({_LABELLED}) WHERE Agrees AND InputDigest IN {{inputs:Array(String)}}
GROUP BY InputDigest
"""


@dataclass
class Deviation:
    """A request whose output differs from its group's majority, and the stage where it first differed."""

    request_id: str
    trace_id: str
    input_digest: str
    output_digest: str
    majority_output: str
    support: int  # requests with the majority output
    group_size: int  # requests with this input
    start_ns: int
    host: str
    stage: str | None  # None: every stage agreed, the difference came after the last one
    rank: str
    input_differed: bool  # the stage's input already differed (blame lies upstream of the recorded stages)


def _window(store: Store, t0_ns: int, t1_ns: int, margin_ns: int) -> dict:
    return {"db": store.database, "t0": t0_ns, "t1": t1_ns, "margin": margin_ns, "pipeline": list(PIPELINE_STAGES)}


def deviations(store: Store, t0_ns: int, t1_ns: int, margin_ns: int = 60_000_000_000) -> list[Deviation]:
    """Every deviating request that started in [t0, t1), oldest first."""
    rows = store.client.query(DEVIATIONS_SQL, parameters=_window(store, t0_ns, t1_ns, margin_ns)).result_rows
    return [
        Deviation(rid, tid, din, dout, maj, int(sup), int(size), int(start), host, stage or None, rank, bool(moved))
        for rid, tid, din, dout, maj, sup, size, start, host, stage, rank, moved in rows
    ]


@dataclass
class Member:
    request_id: str
    trace_id: str
    start_ns: int
    host: str


def agreeing(store: Store, inputs: list[str], t0_ns: int, t1_ns: int) -> dict[str, list[Member]]:
    """For each input digest, its requests with the majority output."""
    params = {**_window(store, t0_ns, t1_ns, 0), "inputs": inputs}
    rows = store.client.query(AGREEING_SQL, parameters=params).result_rows
    return {digest: [Member(rid, tid, int(start), host) for rid, tid, start, host in members] for digest, members in rows}


def nearest(members: list[Member], start_ns: int, host: str) -> Member | None:
    """The baseline among agreeing requests: on another host if one exists (to tell hardware apart), nearest in time."""
    return min(members, key=lambda m: (m.host == host, abs(m.start_ns - start_ns)), default=None)


def stage_order(stage: str | None) -> int:
    """Pipeline position; other stages after the five, a difference after the last stage at the end."""
    if stage is None:
        return 1000
    return PIPELINE_STAGES.index(stage) if stage in PIPELINE_STAGES else 100


def contrast(store: Store, stage: str, keys: list[str], deviations_: list[Deviation], t0_ns: int, t1_ns: int,
             margin_ns: int = 60_000_000_000):  # fmt: skip
    """Counts for :class:`~stagetrace.analysis.causes.Contrast` over the stage's spans of the labelled requests.

    Requests that diverged upstream of the stage are left out: the stage saw another input there, so
    its attribute values say nothing about whether the stage itself diverges.
    """
    from stagetrace.analysis.causes import BUCKET_SQL, RESOURCE, Contrast

    if not keys:
        return None
    value = f"if(startsWith(key, '{RESOURCE}'), ResourceAttributes[substring(key, {len(RESOURCE) + 1})], SpanAttributes[key])"
    sql = f"""
    SELECT key, {BUCKET_SQL.replace('{v}', 'value')} AS bucketed, count(), countIf(TraceId IN {{diverged:Array(String)}})
    FROM (SELECT TraceId, key, {value} AS value
          FROM {{db:Identifier}}.otel_traces ARRAY JOIN {{keys:Array(String)}} AS key
          WHERE Timestamp >= fromUnixTimestamp64Nano({{t0:Int64}} - {{margin:Int64}})
            AND Timestamp < fromUnixTimestamp64Nano({{t1:Int64}} + {{margin:Int64}})
            AND SpanAttributes['stagetrace.stage'] = {{stage:String}}
            AND TraceId IN (SELECT TraceId FROM ({_LABELLED}))
            AND TraceId NOT IN {{upstream:Array(String)}})
    GROUP BY key, bucketed"""
    order = stage_order(stage)
    params = {**_window(store, t0_ns, t1_ns, margin_ns), "stage": stage, "keys": keys,
              "diverged": [d.trace_id for d in deviations_ if d.stage == stage],
              "upstream": [d.trace_id for d in deviations_ if stage_order(d.stage) < order]}  # fmt: skip
    counts = {(k, v): (int(n), int(d)) for k, v, n, d in store.client.query(sql, parameters=params).result_rows}
    spans = sum(n for (k, _), (n, _) in counts.items() if k == keys[0])
    diverged = sum(d for (k, _), (_, d) in counts.items() if k == keys[0])
    return Contrast(counts, spans, diverged)
