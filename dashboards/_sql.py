"""SQL the dashboards and the Grafana-managed alert rules share, written for the ClickHouse data source.

Table names are unqualified: the data source's ``defaultDatabase`` (the store's database) is the
connection's database, so one set of dashboards serves any database name. Values typed by a user reach
SQL only through Grafana variables with an escaping format; the request ID is percent-encoded by
Grafana and decoded by ClickHouse, so no character a user types can end the string literal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from stagetrace import conventions
from stagetrace.conventions import PIPELINE_STAGES

# -- span columns and conditions (docs/design.md#span-conventions). Stage panels read stagetrace_stages, where the
# store has already named each span's stage by the conventions, whichever producer wrote it.
HOST = f"ResourceAttributes['{conventions.HOST}']"  # on the spans and stagetrace_stages alike
STAGES = "stagetrace_stages"
# The Collector's otel_traces and otel_logs as stagetrace reads them (schema.READ_VIEWS): Map attributes whichever
# layout the Collector stores them in (its `json: true` too), so that one set of dashboards serves every store.
SPANS, LOGS = "stagetrace_spans", "stagetrace_logs"
STAGE = "Stage"
PIPELINE_ORDER = "[" + ", ".join(f"'{stage}'" for stage in PIPELINE_STAGES) + "]"
DURATION_MS = "Duration / 1e6"
# One row per request whose all-reduce ran on TP ranks: the hosts its ranks ran on, the host of its lowest rank
# (the group's head), how many distinct ranks reported a span, and the group's size as the ranks say. Fewer ranks than the size: a rank's
# host stopped reporting (a node failed mid-run, or its spans no longer arrive).
TP_REQUESTS = (
    "(SELECT TraceId, any(ServiceName) AS ServiceName, min(Start) AS RequestStart, "
    "arraySort(groupUniqArray(HostName)) AS HostList, arrayStringConcat(HostList, ' ') AS Hosts, "
    "uniqExact(Rank) AS Ranks, argMin(HostName, toUInt32OrZero(Rank)) AS Head, "
    f"max(toUInt32OrZero(Attributes['{conventions.TP_SIZE}'])) AS TpSize FROM {STAGES} "
    "WHERE Stage = 'allreduce' AND Rank != '' AND $__timeFilter(Start) GROUP BY TraceId)"
)
MISSING_RANKS_RATIO = "countIf(Ranks < TpSize) / nullIf(count(), 0)"

# -- per-stage ratios, as fractions of the stage's spans; NULL (Grafana's "No data") rather than NaN without spans
CACHE_HIT_RATIO = "countIf(Attributes['cache.hit'] = 'true') / nullIf(count(), 0)"
TRUNCATED_RATIO = "countIf(Attributes['context.truncated'] = 'true') / nullIf(count(), 0)"
# over SPANS: stage and root spans of the same requests, by the conventions' rules
ALLREDUCE_TIME_SHARE = f"sumIf(Duration, {conventions.STAGE_SQL} = 'allreduce') / nullIf(sumIf(Duration, {conventions.IS_REQUEST_ROOT_SQL}), 0)"

# the request ID a user typed into the trace-lookup dashboard's text box
REQUEST_ID = "decodeURLComponent('${request_id:percentencode}')"


def any_selected(column: str, variable: str) -> str:
    """``column`` is one of the variable's values; no condition when All (or nothing) is selected."""
    return f"$__conditionalAll({column} IN (${{{variable}:singlequote}}), ${variable})"


def peer_key(service: str = "ServiceName", model: str = "Model") -> str:
    """A request's peer key (``conventions.peer_sql``: its service and model) under the default key, as a literal:
    a dashboard's SQL takes no bound parameters. Only requests with the same input and peer key are compared."""
    sql = conventions.peer_sql(service, model)
    for name, on in conventions.peer_parameters(conventions.DEFAULT_PEER_KEY).items():
        sql = sql.replace(f"{{{name}:UInt8}}", str(on))
    return sql


def majority_outputs(where: str) -> str:
    """Per input digest and peer key seen at least twice, the output most of those requests produced.

    The baseline (docs/design.md#divergence-and-cause) for "this output deviates": the majority output among
    requests with the same ``stagetrace.input.digest`` in the same service, for the same model (``peer_key``):
    another service answering the same prompts is no baseline. A tie picks one of the tied outputs.
    """
    return (
        "SELECT InputDigest, Peer, argMax(OutputDigest, requests) AS majority FROM ("
        f"SELECT InputDigest, {peer_key()} AS Peer, OutputDigest, count() AS requests "
        f"FROM ({conventions.requests_sql(where, model=True)}) "
        "WHERE InputDigest != '' AND OutputDigest != '' GROUP BY InputDigest, Peer, OutputDigest"
        ") GROUP BY InputDigest, Peer HAVING sum(requests) >= 2"
    )


# requests joined with the majority output of their input among their peers (alias r, m), for deviating-output
# ratios; requests that sample without a seed differ by design and are neither counted nor part of a majority
REQUESTS = f"({conventions.requests_sql('$__timeFilter(Start)')})"  # one row per request, by the root rule
_COMPARABLE = (
    f"$__timeFilter(Start) AND TraceId NOT IN ({conventions.nondeterministic_traces_sql('$__timeFilter(Start)')})"
)
REQUESTS_WITH_MAJORITY = (
    f"(SELECT *, {peer_key()} AS Peer FROM ({conventions.requests_sql(_COMPARABLE, model=True)})) AS r INNER JOIN ("
    + majority_outputs(_COMPARABLE)
    + ") AS m ON r.InputDigest = m.InputDigest AND r.Peer = m.Peer"
)
DEVIATING_RATIO = "countIf(r.OutputDigest != m.majority) / nullIf(count(), 0)"


def _select(labels: Mapping[str, str], values: Mapping[str, str]) -> str:
    return ", ".join(f"{expression} AS {alias}" for alias, expression in {**labels, **values}.items())


def _where(conditions: Iterable[str]) -> str:
    return " AND ".join(f"({c})" if " OR " in c else c for c in conditions)


def aggregate(
    source: str,
    time_column: str,
    values: Mapping[str, str],
    *,
    labels: Mapping[str, str] | None = None,
    where: Iterable[str] = (),
    having: str = "",
    over_time: bool = True,
) -> str:
    """``values`` aggregated by ``labels`` over the dashboard's time range, per interval when ``over_time``.

    Over time, the first column is ``time`` (what a time-series panel needs) and rows are in time order.
    """
    labels = dict(labels or {})
    grouping = list(labels)
    if over_time:
        labels = {"time": f"$__timeInterval({time_column})", **labels}
        grouping = ["time", *grouping]
    sql = f"SELECT {_select(labels, values)} FROM {source} WHERE {_where([f'$__timeFilter({time_column})', *where])}"
    if grouping:
        sql += f" GROUP BY {', '.join(grouping)}"
    if having:
        sql += f" HAVING {having}"
    if grouping:
        sql += f" ORDER BY {', '.join(grouping)}"
    return sql


# -- hardware metrics: otel_metrics_gauge / otel_metrics_sum as the metric writer fills them

GPU = "concat(ResourceAttributes['host.name'], ' GPU ', Attributes['gpu'])"
NIC_PORT = "concat(ResourceAttributes['host.name'], ' ', Attributes['device'], '/', Attributes['port'])"
NETDEV = "concat(ResourceAttributes['host.name'], ' ', Attributes['netdev'])"
# rdma_np_cnp_sent_total -> np_cnp_sent: the driver's own counter name, which is what operators search for
SHORT_NAME = "replaceRegexpOne(MetricName, '^(rdma|nic)_(.*?)(_total)?$', '\\\\2')"


def _metric_names(metrics: str | Iterable[str]) -> str:
    names = [metrics] if isinstance(metrics, str) else list(metrics)
    if len(names) == 1:
        return f"MetricName = '{names[0]}'"
    return "MetricName IN (" + ", ".join(f"'{name}'" for name in names) + ")"


def gauge(
    metrics: str | Iterable[str],
    labels: Mapping[str, str],
    value: str,
    *,
    where: Iterable[str] = (),
    function: str = "avg",
    scale: str = "",
) -> str:
    """A gauge per interval and series: ``function(Value)`` (``avg`` smooths, ``max`` keeps short spikes)."""
    return aggregate(
        "otel_metrics_gauge",
        "TimeUnix",
        {value: f"{function}(Value){scale}"},
        labels=labels,
        where=[_metric_names(metrics), *where],
    )


def counter(
    metrics: str | Iterable[str],
    labels: Mapping[str, str],
    value: str,
    *,
    where: Iterable[str] = (),
    per_second: bool = True,
    from_series_start: bool = False,
    scale: str = "",
) -> str:
    """A counter's increase per interval (or per second), reset-safe, per series.

    Increases are taken between consecutive samples of one series (metric, host, labels). A value
    below the previous one, or a new start time, is a reset (a driver reload, a 32-bit mlx5 counter
    wrapping): the new value is the increase, never a negative difference. The first sample in the
    range only sets the base, as Prometheus' ``increase()`` does, unless ``from_series_start``: for
    series that appear at their first event (``gpu_xid_errors_total{xid}`` starts at 1), the whole
    history up to the range's end is read so that a series' first sample counts from zero.
    """
    labels = dict(labels)
    inner_where = [_metric_names(metrics), *where]
    inner_where.append("TimeUnix <= $__toTime" if from_series_start else "$__timeFilter(TimeUnix)")
    samples = (
        f"SELECT TimeUnix, {_select(labels, {})}, "
        "if(Value < previous OR StartTimeUnix != previous_start, Value, Value - previous) AS increase, sample "
        "FROM (SELECT TimeUnix, StartTimeUnix, Value, MetricName, ResourceAttributes, Attributes, "
        "lagInFrame(Value) OVER series AS previous, lagInFrame(StartTimeUnix) OVER series AS previous_start, "
        "row_number() OVER series AS sample "
        f"FROM otel_metrics_sum WHERE {_where(inner_where)} "
        "WINDOW series AS (PARTITION BY MetricName, ResourceAttributes['host.name'], Attributes ORDER BY TimeUnix "
        "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW))"
    )
    if not from_series_start:
        samples += " WHERE sample > 1"
    total = "sum(increase) / $__interval_s" if per_second else "sum(increase)"
    return aggregate(f"({samples})", "TimeUnix", {value: total + scale}, labels={k: k for k in labels})


# -- rails: the RDMA ports the collector names a rail (rdma_port_info's ``rail`` label; by default every port)
RAIL_FILTER = (
    "(ResourceAttributes['host.name'], Attributes['device'], Attributes['port']) IN ("
    "SELECT ResourceAttributes['host.name'], Attributes['device'], Attributes['port'] FROM otel_metrics_gauge "
    "WHERE MetricName = 'rdma_port_info' AND Attributes['rail'] != '' AND $__timeFilter(TimeUnix))"
)


def rail_bytes(where: Iterable[str] = ()) -> str:
    """Per interval, host and rail port: bytes per second both ways (transmit + receive), reset-safe."""
    return counter(
        ["rdma_port_transmit_bytes_total", "rdma_port_receive_bytes_total"],
        {"host": HOST, "port": NIC_PORT},
        "bytes",
        where=[RAIL_FILTER, *where],
    )


def rail_rates(where: Iterable[str] = ()) -> str:
    """Per interval, host and rail port: the negotiated data rate (bytes per second)."""
    return gauge(
        "rdma_port_rate_bytes_per_second",
        {"host": HOST, "port": NIC_PORT},
        "rate",
        where=[RAIL_FILTER, *where],
        function="min",
    )


# -- weight transfer (conventions: one sync span per step, one span per link)
def _attr(key: str) -> str:
    return f"SpanAttributes['{key}']"


WEIGHT_SYNCS = (
    f"(SELECT TraceId, Timestamp AS Start, Duration, ServiceName, StatusCode, "
    f"toInt64OrZero({_attr(conventions.WEIGHTS_STEP)}) AS Step, toFloat64OrZero({_attr(conventions.SYNC_BYTES)}) AS Bytes, "
    f"toUInt32OrZero({_attr(conventions.SYNC_SOURCE_RANKS)}) AS SourceRanks, "
    f"toUInt32OrZero({_attr(conventions.SYNC_DESTINATION_RANKS)}) AS DestinationRanks "
    f"FROM {SPANS} WHERE {conventions.IS_WEIGHT_SYNC_SQL} AND $__timeFilter(Timestamp))"
)
WEIGHT_LINKS = (
    f"(SELECT TraceId, Timestamp AS Start, Duration, StatusCode, toFloat64OrZero({_attr(conventions.LINK_BYTES)}) AS Bytes, "
    f"concat({_attr(conventions.LINK_SOURCE_HOST)}, ' ', {_attr(conventions.LINK_SOURCE_DEVICE)}) AS SourceNic, "
    f"concat({_attr(conventions.LINK_DESTINATION_HOST)}, ' ', {_attr(conventions.LINK_DESTINATION_DEVICE)}) AS DestinationNic, "
    f"{_attr(conventions.LINK_DESTINATION_GPU)} AS DestinationGpu "
    f"FROM {SPANS} WHERE mapContains(SpanAttributes, '{conventions.LINK_BYTES}') AND $__timeFilter(Timestamp))"
)
# each NIC's negotiated rate, the last in the range (for a link's line rate)
NIC_RATES = (
    f"(SELECT concat({HOST}, ' ', Attributes['device']) AS Nic, argMax(Value, TimeUnix) AS Rate "
    "FROM otel_metrics_gauge WHERE MetricName = 'rdma_port_rate_bytes_per_second' AND $__timeFilter(TimeUnix) "
    "GROUP BY Nic)"
)
# Per sync and side (source, destination): each NIC's bytes and line rate.
_SYNC_NICS = (
    f"(SELECT TraceId, Side, Nic, NicBytes, Rate FROM ("
    f"SELECT TraceId, 'source' AS Side, SourceNic AS Nic, sum(Bytes) AS NicBytes FROM {WEIGHT_LINKS} GROUP BY TraceId, Nic "
    f"UNION ALL SELECT TraceId, 'destination' AS Side, DestinationNic AS Nic, sum(Bytes) AS NicBytes FROM {WEIGHT_LINKS} "
    f"GROUP BY TraceId, Nic) AS n LEFT JOIN {NIC_RATES} AS r USING (Nic))"
)
# One row per sync: its throughput against the line rate of the NICs it used (the slower side's sum), and the
# share of its bytes through the busiest NIC of each side. Fan-in: a side's busiest NIC carried FAN_IN_FACTOR
# times its even share (1 / that side's ranks) or more.
_SHARE = "maxIf(NicBytes, Side = '{side}') / nullIf(sumIf(NicBytes, Side = '{side}'), 0)"
SYNC_SUMMARY = (
    "(SELECT s.TraceId AS TraceId, s.Start AS Start, s.ServiceName AS ServiceName, s.Step AS Step, "
    "s.Bytes AS Bytes, s.Duration / 1e9 AS Seconds, s.Bytes / nullIf(Seconds, 0) AS Throughput, "
    "s.StatusCode AS StatusCode, s.SourceRanks AS SourceRanks, s.DestinationRanks AS DestinationRanks, "
    "least(n.SourceRate, n.DestinationRate) AS LineRate, Throughput / nullIf(LineRate, 0) AS LineRateShare, "
    "n.BusiestSource AS BusiestSource, n.SourceShare AS SourceShare, "
    "n.BusiestDestination AS BusiestDestination, n.DestinationShare AS DestinationShare, "
    f"(SourceRanks >= 2 AND SourceShare >= least(1, {conventions.FAN_IN_FACTOR} / SourceRanks)) "
    f"OR (DestinationRanks >= 2 AND DestinationShare >= least(1, {conventions.FAN_IN_FACTOR} / DestinationRanks)) AS FanIn "
    f"FROM {WEIGHT_SYNCS} AS s INNER JOIN ("
    "SELECT TraceId, sumIf(Rate, Side = 'source') AS SourceRate, sumIf(Rate, Side = 'destination') AS DestinationRate, "
    "argMaxIf(Nic, NicBytes, Side = 'source') AS BusiestSource, "
    f"{_SHARE.format(side='source')} AS SourceShare, "
    "argMaxIf(Nic, NicBytes, Side = 'destination') AS BusiestDestination, "
    f"{_SHARE.format(side='destination')} AS DestinationShare "
    f"FROM {_SYNC_NICS} GROUP BY TraceId) AS n ON s.TraceId = n.TraceId)"
)

# Which weights each inference GPU serves (conventions: a GPU's step and its fleet's): per GPU, its step, when that
# step first served there, and its fleet's step.
GPU_STEP_SPANS = (
    f"(SELECT ServiceName, HostName, Attributes['{conventions.GPU_UUID}'] AS Gpu, "
    f"{conventions.STEP_SQL} AS Step, Start FROM {STAGES} "
    f"WHERE Stage = 'decode' AND Gpu != '' AND {conventions.IS_STEP_SQL} AND $__timeFilter(Start))"
)
GPU_STEPS = (
    "(SELECT ServiceName, HostName, Gpu, Step, Arrived, LastSeen, FleetStep, FleetStep - Step AS StepsBehind FROM ("
    "SELECT ServiceName, HostName, Gpu, argMax(Step, Last) AS Step, argMax(First, Last) AS Arrived, "
    "max(Last) AS LastSeen FROM (SELECT ServiceName, HostName, Gpu, Step, min(Start) AS First, max(Start) AS Last "
    f"FROM {GPU_STEP_SPANS} GROUP BY ServiceName, HostName, Gpu, Step) GROUP BY ServiceName, HostName, Gpu) AS g "
    f"INNER JOIN (SELECT ServiceName, {conventions.fleet_step_sql('Step')} AS FleetStep FROM ("
    f"SELECT ServiceName, Gpu, argMax(Step, Start) AS Step FROM {GPU_STEP_SPANS} GROUP BY ServiceName, Gpu) "
    "GROUP BY ServiceName) AS f USING (ServiceName))"
)
