"""Compare two requests: stage by stage, side by side (Grafana's ``stagetrace explain REQUEST --against OTHER``).

Both requests are found from their IDs alone, as in the trace lookup. Each stage (and each TP rank of it) is one
row: where each ran, whether its input and its output are the same for both, and the attributes whose values
differ; the counters table shows, for each request, what rose on the hardware its spans name while it ran.
"""

from __future__ import annotations

from stagetrace import conventions
from stagetrace.dashboards import _panels as p
from stagetrace.dashboards import trace_lookup
from stagetrace.dashboards._sql import PIPELINE_ORDER, REQUEST_ID, STAGE, STAGES

UID = "stagetrace-compare"
OTHER_REQUEST_ID = REQUEST_ID.replace("request_id", "other_request_id")
_stored = conventions.stored_request_id_sql  # the ID as stored, by the CLI's rule (trace_lookup.STORED_ID)


def _request(request_id: str) -> str:
    """(trace ID, start, end) of the newest root span with that request ID (or Dynamo's response ID for it, as in the
    trace lookup)."""
    return (
        f"(SELECT (TraceId, Start, End) FROM stagetrace_requests WHERE RequestId = {_stored(request_id)} "
        "ORDER BY Start DESC LIMIT 1)"
    )


def _stages(request: str) -> str:
    """One request's stage spans, keyed by stage and rank."""
    return f"""
    SELECT {STAGE} AS stage, Rank AS rank, any(HostName) AS host, any(Attributes['gpu.uuid']) AS gpu,
           any(InputDigest) AS input_digest, any(OutputDigest) AS output_digest,
           any(mapFilter((k, v) -> NOT startsWith(k, 'stagetrace.'), Attributes)) AS attributes
    FROM {STAGES}
    WHERE TraceId = {request}.1 AND Start >= {request}.2 - INTERVAL 1 MINUTE AND Start <= {request}.3 + INTERVAL 1 MINUTE
    GROUP BY stage, rank"""


def _same(column: str) -> str:
    return (
        f"multiIf(a.{column} = '' AND b.{column} = '', '', a.{column} = b.{column}, 'same', "
        f"a.{column} = '' OR b.{column} = '', 'missing', 'different')"
    )


# the attributes whose values differ, as "key: a -> b"; a stage's own outputs and timings differ by nature, but are
# shown: this is the raw comparison, the ranking of causes is the analysis's (stagetrace explain)
_DIFFERING = (
    "arrayStringConcat(arrayMap(k -> concat(k, ': ', a.attributes[k], ' -> ', b.attributes[k]), "
    "arraySort(arrayFilter(k -> a.attributes[k] != b.attributes[k], "
    "arrayDistinct(arrayConcat(mapKeys(a.attributes), mapKeys(b.attributes)))))), '; ')"
)

STAGES_SQL = f"""
SELECT if(a.stage != '', a.stage, b.stage) AS stage, if(a.stage != '', a.rank, b.rank) AS rank,
    a.host AS host, b.host AS other_host, a.gpu AS gpu, b.gpu AS other_gpu,
    {_same("input_digest")} AS input, {_same("output_digest")} AS output, {_DIFFERING} AS differing_attributes
FROM ({_stages(_request(REQUEST_ID))}) AS a
FULL OUTER JOIN ({_stages(_request(OTHER_REQUEST_ID))}) AS b ON a.stage = b.stage AND a.rank = b.rank
ORDER BY indexOf({PIPELINE_ORDER}, stage) = 0, indexOf({PIPELINE_ORDER}, stage), stage, rank"""

REQUESTS_SQL = f"""
SELECT RequestId AS request_id, ServiceName AS service, HostName AS host, Start AS start,
    dateDiff('microsecond', Start, End) / 1000 AS duration_ms, InputDigest AS input_digest,
    OutputDigest AS output_digest
FROM stagetrace_requests
WHERE RequestId IN ({_stored(REQUEST_ID)}, {_stored(OTHER_REQUEST_ID)})
ORDER BY RequestId = {_stored(OTHER_REQUEST_ID)}, Start DESC
LIMIT 1 BY RequestId"""


def _counters(request_id: str) -> str:
    """What rose on the request's hardware while it ran: the trace lookup's counters table for that request."""
    return trace_lookup.COUNTERS_SQL.replace(REQUEST_ID, request_id)


COUNTERS_SQL = f"""
SELECT * FROM (
    SELECT 'request' AS which, * FROM ({_counters(REQUEST_ID)}) WHERE during_request > 0 OR in_10_min_before > 0
    UNION ALL
    SELECT 'other' AS which, * FROM ({_counters(OTHER_REQUEST_ID)}) WHERE during_request > 0 OR in_10_min_before > 0)
ORDER BY which DESC, during_request DESC, in_10_min_before DESC"""


def panels() -> list[dict]:
    links = [p.override("request_id", links=[p.trace_lookup_link("request_id")]), p.override("duration_ms", unit="ms")]
    return [
        p.table(
            "The two requests",
            REQUESTS_SQL,
            "none",
            height=5,
            overrides=links,
            description="Their root spans: same input digest means the outputs should agree.",
        ),
        p.table(
            "Stage by stage",
            STAGES_SQL,
            "none",
            height=10,
            description="One row per stage and TP rank, in pipeline order: where each request ran it, whether "
            "its input and its output were the same for both, and the attributes whose values differ "
            "(request -> other). The first stage whose output differs while its input is the same is "
            "where they diverged.",
        ),
        p.table(
            "Counters that rose while each request ran",
            COUNTERS_SQL,
            "short",
            height=10,
            sort_by="during_request",
            description="For each request, the counters of the GPUs, RDMA ports, netdevs and hosts its spans name "
            "that rose during it or in the ten minutes before (as in the trace lookup): a counter that "
            "rose for one and not the other is a hardware suspect.",
        ),
    ]


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.text_variable("request_id", "Request ID", "The request to explain, e.g. a deviating one."),
        p.text_variable(
            "other_request_id",
            "Other request ID",
            "The request to compare it with, e.g. its baseline in the divergence explorer.",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: compare two requests",
        "Set two request IDs: their stages side by side, what differs between them, and the hardware counters that "
        "rose while each ran.",
        panels(),
        variables(),
        time_from="now-24h",
        refresh="",
    )
