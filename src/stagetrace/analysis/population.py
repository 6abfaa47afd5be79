"""Who deviates, and where: majority outputs, deviating requests and first divergent stages, computed in ClickHouse.

Requests are grouped by ``InputDigest``; a group's majority output is its most common output when
at least two requests share it and no other output is as common. A request deviates when its
output differs from its group's majority. Its baseline is the agreeing request of its group nearest
in time, on another host when there is one (so that the hardware differs), and its first divergent
stage is the first stage, in pipeline order, whose output digest differs from the baseline's (a
stage the baseline ran and the request did not also counts), as ``explain`` compares two requests.
Grouping, majorities, baselines and the stage comparison run as SQL; only deviating requests come back.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace import conventions
from stagetrace.conventions import PIPELINE_STAGES
from stagetrace.store import Store

# Stages outside the pipeline's named five come after them, in the order the baseline ran them.
_ORDER = "if(indexOf({pipeline:Array(String)}, Stage) = 0, 100, indexOf({pipeline:Array(String)}, Stage))"

# Requests in the window (one per trace, by the conventions' root rule), latest trace per request ID (a retry
# reuses the ID).
_REQUESTS = f"""
    SELECT RequestId, argMax(TraceId, S) AS TraceId, argMax(InputDigest, S) AS InputDigest,
           argMax(OutputDigest, S) AS OutputDigest, max(S) AS Start, argMax(HostName, S) AS HostName
    FROM (SELECT RequestId, TraceId, InputDigest, OutputDigest, Start AS S, HostName
          FROM ({conventions.requests_sql(
              "Start >= fromUnixTimestamp64Nano({t0:Int64}) AND Start < fromUnixTimestamp64Nano({t1:Int64})",
              "{db:Identifier}.stagetrace_requests")}))
    GROUP BY RequestId
    HAVING InputDigest != ''"""

# Each deviating request with its baseline, in one pass over the window's requests: the members of an
# input group are gathered into an array, and its majority and the baselines found with array functions.
PAIRS_SQL = f"""
SELECT tupleElement(d, 1), tupleElement(d, 2), InputDigest, tupleElement(d, 3), Majority, Support, length(members),
       tupleElement(d, 4), tupleElement(d, 5), tupleElement(b, 1), tupleElement(b, 2)
FROM (
    SELECT InputDigest, members, Majority, Support,
           arrayFilter(m -> tupleElement(m, 3) = Majority, members) AS agreeing,
           arrayFilter(m -> tupleElement(m, 3) != Majority, members) AS deviating
    FROM (
        SELECT InputDigest, members, arrayMap(m -> tupleElement(m, 3), members) AS outs, arrayDistinct(outs) AS outputs,
               arrayMap(o -> countEqual(outs, o), outputs) AS counts,
               arrayMax(counts) AS Support, outputs[indexOf(counts, Support)] AS Majority
        FROM (SELECT InputDigest, groupArray((RequestId, TraceId, OutputDigest, toUnixTimestamp64Nano(Start), HostName)) AS members
              FROM ({_REQUESTS}) GROUP BY InputDigest)
        WHERE Support >= 2 AND countEqual(counts, Support) = 1)
    WHERE notEmpty(deviating))
ARRAY JOIN deviating AS d
ARRAY JOIN [arraySort(a -> (tupleElement(a, 5) = tupleElement(d, 5), abs(tupleElement(a, 4) - tupleElement(d, 4))), agreeing)[1]] AS b
ORDER BY tupleElement(d, 4)
"""

# Per pair, the first stage where the request's output differs from the baseline's. One scan: each
# stage span of either trace is tagged with its pair, then both sides meet per (pair, stage, rank).
# A stage's passes are its spans not nested in one of the same stage (conventions.stage_passes): its
# input is the first pass's, its output all passes' outputs in start order (conventions.combined_output).
# Spans may start a little before or after their root (ranks on other hosts), hence the margin.
_TAGGED_STAGES = """
        SELECT s.Stage AS Stage, s.Rank AS Rank, s.InputDigest AS StageIn, s.OutputDigest AS StageOut,
               toUnixTimestamp64Nano(s.Start) AS SpanStart, t.Dev AS Dev, t.Own AS Own, s.TraceId AS TraceId,
               s.SpanId AS SpanId, s.ParentSpanId AS ParentSpanId
        FROM {db:Identifier}.stagetrace_stages AS s
        INNER JOIN (SELECT tupleElement(x, 1) AS TraceId, tupleElement(x, 2) AS Dev, tupleElement(x, 3) AS Own
                    FROM (SELECT arrayJoin([(tupleElement(p, 1), tupleElement(p, 1), true), (tupleElement(p, 2), tupleElement(p, 1), false)]) AS x
                          FROM (SELECT arrayJoin(arrayZip({devs:Array(String)}, {bases:Array(String)})) AS p))) AS t
            ON s.TraceId = t.TraceId
        WHERE s.Start >= fromUnixTimestamp64Nano({t0:Int64} - {margin:Int64})
          AND s.Start < fromUnixTimestamp64Nano({t1:Int64} + {margin:Int64})"""
_OUT = conventions.COMBINED_OUTPUT_SQL
FIRST_STAGES_SQL = f"""
WITH tagged AS ({_TAGGED_STAGES})
SELECT Dev, argMin((Stage, Rank, HasOwn AND OwnIn != BaseIn), ({_ORDER}, BaseStart))
FROM (
    SELECT Dev, Stage, Rank, countIf(Own) > 0 AS HasOwn, countIf(NOT Own) > 0 AS HasBase,
           argMinIf(StageIn, SpanStart, Own) AS OwnIn, {_OUT.format(pairs="groupArrayIf((SpanStart, StageOut), Own)")} AS OwnOut,
           argMinIf(StageIn, SpanStart, NOT Own) AS BaseIn,
           {_OUT.format(pairs="groupArrayIf((SpanStart, StageOut), NOT Own)")} AS BaseOut, minIf(SpanStart, NOT Own) AS BaseStart
    FROM tagged AS a
    WHERE NOT {conventions.NESTED_IN_SAME_STAGE_SQL.format(a="a", spans="tagged")}
    GROUP BY Dev, Stage, Rank)
WHERE HasBase AND (NOT HasOwn OR OwnOut != BaseOut)
GROUP BY Dev
"""


@dataclass
class Deviation:
    """A request whose output differs from its group's majority, its baseline, and the stage where it first differed."""

    request_id: str
    trace_id: str
    input_digest: str
    output_digest: str
    majority_output: str
    support: int  # requests with the majority output
    group_size: int  # requests with this input
    start_ns: int
    host: str
    baseline_request_id: str
    baseline_trace_id: str
    stage: str | None  # None: every stage agreed, the difference came after the last one
    rank: str
    input_differed: bool  # the stage's input already differed (blame lies upstream of the recorded stages)


def _window(store: Store, t0_ns: int, t1_ns: int, margin_ns: int) -> dict:
    return {"db": store.database, "t0": t0_ns, "t1": t1_ns, "margin": margin_ns, "pipeline": list(PIPELINE_STAGES)}


def deviations(store: Store, t0_ns: int, t1_ns: int, margin_ns: int = 60_000_000_000) -> list[Deviation]:
    """Every deviating request that started in [t0, t1), oldest first, with its baseline and first divergent stage."""
    params = _window(store, t0_ns, t1_ns, margin_ns)
    pairs = store.client.query(PAIRS_SQL, parameters=params).result_rows
    if not pairs:
        return []
    devs, bases = [row[1] for row in pairs], [row[10] for row in pairs]
    first = dict(store.client.query(FIRST_STAGES_SQL, parameters={**params, "devs": devs, "bases": bases}).result_rows)
    out = []
    for rid, tid, din, dout, maj, sup, size, start, host, base_rid, base_tid in pairs:
        stage, rank, moved = first.get(tid, ("", "", False))
        out.append(Deviation(rid, tid, din, dout, maj, int(sup), int(size), int(start), host, base_rid, base_tid,
                             stage or None, rank, bool(moved)))  # fmt: skip
    return out


@dataclass
class Member:
    request_id: str
    trace_id: str
    start_ns: int
    host: str


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
    """Counts for :class:`~stagetrace.analysis.causes.Contrast` over the stage's spans in the window.

    Requests that diverged upstream of the stage are left out: the stage saw another input there, so
    its attribute values say nothing about whether the stage itself diverges.
    """
    from stagetrace.analysis.causes import BUCKET_SQL, RESOURCE, Contrast

    if not keys:
        return None
    value = f"if(startsWith(key, '{RESOURCE}'), ResourceAttributes[substring(key, {len(RESOURCE) + 1})], Attributes[key])"
    sql = f"""
    SELECT key, {BUCKET_SQL.replace('{v}', 'value')} AS bucketed, count(), countIf(TraceId IN (SELECT arrayJoin({{diverged:Array(String)}})))
    FROM (SELECT TraceId, key, {value} AS value
          FROM {{db:Identifier}}.stagetrace_stages ARRAY JOIN {{keys:Array(String)}} AS key
          WHERE Stage = {{stage:String}}
            AND Start >= fromUnixTimestamp64Nano({{t0:Int64}} - {{margin:Int64}})
            AND Start < fromUnixTimestamp64Nano({{t1:Int64}} + {{margin:Int64}})
            AND TraceId NOT IN (SELECT arrayJoin({{upstream:Array(String)}})))
    GROUP BY key, bucketed"""
    order = stage_order(stage)
    params = {**_window(store, t0_ns, t1_ns, margin_ns), "stage": stage, "keys": keys,
              "diverged": [d.trace_id for d in deviations_ if d.stage == stage],
              "upstream": [d.trace_id for d in deviations_ if stage_order(d.stage) < order]}  # fmt: skip
    counts = {(k, v): (int(n), int(d)) for k, v, n, d in store.client.query(sql, parameters=params).result_rows}
    spans = sum(n for (k, _), (n, _) in counts.items() if k == keys[0])
    diverged = sum(d for (k, _), (_, d) in counts.items() if k == keys[0])
    return Contrast(counts, spans, diverged)
