"""Weights: RL weight syncs (throughput per step against the line rate, fan-in) and which step each GPU serves.

Reads the weight-transfer spans of the conventions (one sync span per step, one span per link) and the decode
spans' ``model.weights.step`` and ``gpu.uuid``: a sync says what the trainer sent, the decode spans say what each
inference GPU actually served with, and when that step first served there.
"""

from __future__ import annotations

from stagetrace import conventions
from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import (
    GPU_STEP_SPANS,
    GPU_STEPS,
    NIC_RATES,
    STAGES,
    SYNC_SUMMARY,
    WEIGHT_LINKS,
    any_selected,
)

UID = "stagetrace-weights"

SERVICE_FILTER = any_selected("ServiceName", "service")


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.query_variable(
            "service",
            "Service",
            f"SELECT DISTINCT ServiceName FROM {STAGES} WHERE Stage = 'decode' "
            f"AND Attributes['{conventions.WEIGHTS_STEP}'] != '' AND $__timeFilter(Start) ORDER BY ServiceName",
            description="The inference services whose GPUs' weight steps the board shows.",
        ),
    ]


def panels() -> list[dict]:
    links = (
        "SELECT l.SourceNic AS source_nic, l.DestinationNic AS destination_nic, count() AS writes, "
        "countIf(l.StatusCode = 'Error') AS failed, sum(l.Bytes) AS bytes, "
        "sum(l.Bytes) / nullIf(sum(l.Duration) / 1e9, 0) AS bandwidth, least(any(s.Rate), any(d.Rate)) AS line_rate, "
        "bandwidth / nullIf(line_rate, 0) AS of_line_rate "
        f"FROM {WEIGHT_LINKS} AS l LEFT JOIN {NIC_RATES} AS s ON l.SourceNic = s.Nic "
        f"LEFT JOIN {NIC_RATES} AS d ON l.DestinationNic = d.Nic "
        "GROUP BY source_nic, destination_nic ORDER BY bytes DESC, source_nic, destination_nic"
    )
    syncs = (
        "SELECT Start AS start, ServiceName AS service, Step AS step, Seconds AS seconds, Bytes AS bytes, "
        "Throughput AS throughput, LineRate AS line_rate, LineRateShare AS of_line_rate, "
        "BusiestSource AS busiest_source, SourceShare AS source_share, "
        "BusiestDestination AS busiest_destination, DestinationShare AS destination_share, "
        "if(FanIn, 'fan-in', '') AS fan_in, StatusCode AS status "
        f"FROM {SYNC_SUMMARY} ORDER BY start DESC"
    )
    return [
        p.row("Weight syncs"),
        p.timeseries(
            "Sync throughput per step",
            "SELECT $__timeInterval(Start) AS time, max(Throughput) AS throughput, max(LineRate) AS line_rate "
            f"FROM {SYNC_SUMMARY} GROUP BY time ORDER BY time",
            "Bps",
            bars=True,
            width=12,
            description="Bytes per second of each sync (its bytes over its duration) against the line rate "
            "of the NICs it used (the slower side's sum).",
        ),
        p.timeseries(
            "Fan-in: busiest NIC's share",
            "SELECT $__timeInterval(Start) AS time, max(SourceShare) AS source, "
            f"max(DestinationShare) AS destination FROM {SYNC_SUMMARY} GROUP BY time ORDER BY time",
            "percentunit",
            bars=True,
            max_value=1,
            width=12,
            description="Per sync, the share of its bytes through the busiest source NIC and destination "
            "NIC. 100% on the source side with many training ranks: the sync funnels through "
            "one GPU (the rank-0 pattern), limited by a single NIC.",
        ),
        p.table(
            "Weight syncs",
            syncs,
            "none",
            height=8,
            overrides=[
                p.override("start", unit="dateTimeAsIso"),
                p.override("seconds", unit="s"),
                p.override("bytes", unit="decbytes"),
                p.override("throughput", unit="Bps"),
                p.override("line_rate", unit="Bps"),
                p.override("of_line_rate", unit="percentunit"),
                p.override("source_share", unit="percentunit"),
                p.override("destination_share", unit="percentunit"),
            ],
            description="Every sync in the range, newest first: its step, duration, bytes, throughput against the "
            "line rate, the busiest NIC of each side and its share, and fan-in when one NIC carried "
            f"{conventions.FAN_IN_FACTOR:g} times its even share or more.",
        ),
        p.table(
            "Link bandwidth",
            links,
            "none",
            height=8,
            overrides=[
                p.override("bytes", unit="decbytes"),
                p.override("bandwidth", unit="Bps"),
                p.override("line_rate", unit="Bps"),
                p.override("of_line_rate", unit="percentunit"),
            ],
            description="Per link (source NIC to destination NIC) over the range: writes, failed writes, bytes, "
            "achieved bandwidth against the slower end's negotiated rate.",
        ),
        p.row("Weights per GPU"),
        p.table(
            "Step served per GPU",
            "SELECT HostName AS host, Gpu AS gpu, Step AS step, StepsBehind AS steps_behind, Arrived AS arrived, "
            f"LastSeen AS last_seen, FleetStep AS fleet_step, ServiceName AS service FROM {GPU_STEPS} "
            f"WHERE {SERVICE_FILTER} ORDER BY steps_behind DESC, host, gpu",
            "none",
            height=8,
            overrides=[p.override("arrived", unit="dateTimeAsIso"), p.override("last_seen", unit="dateTimeAsIso")],
            description="Each inference GPU's step, from its latest decode span, when that step first served "
            "there (arrived), and how many steps it is behind its fleet (the median GPU of its "
            "service). A GPU behind the fleet missed a sync: it serves older weights.",
        ),
        p.timeseries(
            "Step per GPU",
            "SELECT $__timeInterval(Start) AS time, concat(HostName, ' ', Gpu) AS gpu, max(Step) AS step "
            f"FROM {GPU_STEP_SPANS} WHERE {SERVICE_FILTER} GROUP BY time, gpu ORDER BY time, gpu",
            "none",
            width=24,
            description="The step each GPU served with over time: a staircase per sync; a GPU whose stair "
            "is missing a step did not receive it.",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: Weights",
        "RL weight syncs: throughput per step against the line rate, fan-in through one NIC, bandwidth per link; and "
        "the step of the weights each inference GPU serves, with when it arrived.",
        panels(),
        variables(),
    )
