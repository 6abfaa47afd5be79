"""Fabric: the RDMA rails under tensor parallelism, loss and congestion beside the all-reduce time, TP groups.

What an operator running TP across hosts asks of the fabric: does each host carry its rails' worth (two rails,
2.00 times one)? Did a link come up slower than its peers? When the all-reduce slowed, which counter rose with
it? Is every host of a TP group still there? Rails are the ports ``rdma_port_info`` names a rail (the rdma
collector's ``--rdma-rails``; by default every port).
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import (
    DURATION_MS,
    HOST,
    MISSING_RANKS_RATIO,
    NETDEV,
    NIC_PORT,
    SHORT_NAME,
    STAGE,
    STAGES,
    TP_REQUESTS,
    aggregate,
    any_selected,
    counter,
    gauge,
    rail_bytes,
    rail_rates,
)

UID = "stagetrace-fabric"

HOST_FILTER = any_selected(HOST, "host")


def port_counters(metrics: list[str], value: str) -> str:
    return counter(metrics, {"port": NIC_PORT, "counter": SHORT_NAME}, value, where=[HOST_FILTER])


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.query_variable(
            "host",
            "Host",
            f"SELECT host FROM (SELECT DISTINCT {HOST} AS host FROM otel_metrics_gauge "
            "WHERE MetricName = 'rdma_port_info' AND $__timeFilter(TimeUnix) "
            f"UNION DISTINCT SELECT DISTINCT HostName AS host FROM {STAGES} "
            "WHERE Stage = 'allreduce' AND Rank != '' AND $__timeFilter(Start)) ORDER BY host",
        ),
    ]


def rail_panels() -> list[dict]:
    traffic = rail_bytes([HOST_FILTER])
    utilisation = (
        f"SELECT time, port, bytes / nullIf(2 * rate, 0) AS utilisation FROM ({traffic}) AS b "
        f"INNER JOIN ({rail_rates([HOST_FILTER])}) AS r USING (time, host, port) ORDER BY time, port"
    )
    carried = (
        f"SELECT time, host, sum(bytes) / nullIf(max(bytes), 0) AS rails_carried FROM ({traffic}) "
        "GROUP BY time, host HAVING count() > 1 ORDER BY time, host"
    )
    # a rail is below its peers when it runs slower than the host's fastest rail at that moment, or than its own
    # best in the range (a single-rail host has no other rail to compare with)
    below = (
        "SELECT host, port, min(rate) AS slowest, max(best) AS expected, minIf(time, rate < best) AS since, "
        "maxIf(time, rate < best) AS last_below FROM ("
        "SELECT time, host, port, rate, greatest(max(rate) OVER (PARTITION BY time, host), "
        f"max(rate) OVER (PARTITION BY host, port)) AS best FROM ({rail_rates([HOST_FILTER])})) "
        "GROUP BY host, port HAVING countIf(rate < best) > 0 ORDER BY since, port"
    )
    return [
        p.row("Rails"),
        p.timeseries(
            "Rail throughput",
            traffic,
            "Bps",
            width=8,
            description="Bytes per second each rail port carries, transmit and receive together.",
        ),
        p.timeseries(
            "Rail utilisation",
            utilisation,
            "percentunit",
            max_value=1,
            width=8,
            description="Each rail's traffic (both ways) against twice its negotiated rate.",
        ),
        p.timeseries(
            "Rails carried",
            carried,
            "none",
            width=8,
            description="Per host, its rails' traffic over its busiest rail's: 2.00 on a balanced two-rail "
            "host, 1.2 when one rail idles (NCCL does not see it, or traffic funnels through "
            "one NIC).",
        ),
        p.table(
            "Rails below their peers",
            below,
            "Bps",
            width=24,
            height=6,
            overrides=[p.override("since", unit="dateTimeAsIso"), p.override("last_below", unit="dateTimeAsIso")],
            description="Rail links that negotiated below the host's fastest rail at that moment, or below "
            "their own best in the range (a 400 Gb/s port at 100: a cable or transceiver fault); "
            "since / last_below: when the link was first and last seen slow.",
        ),
    ]


def loss_panels() -> list[dict]:
    collective = "concat(ResourceAttributes['host.name'], ' CUDA ', Attributes['cuda_device'])"
    return [
        p.row("Loss and congestion beside the all-reduce"),
        p.timeseries(
            "All-reduce time per request",
            aggregate(
                STAGES,
                "Start",
                {"p50": f"quantile(0.5)({DURATION_MS})", "p99": f"quantile(0.99)({DURATION_MS})"},
                labels={"host": HOST},
                where=[f"{STAGE} = 'allreduce'", HOST_FILTER],
            ),
            "ms",
            width=8,
            description="The pipeline's own all-reduce stage spans per host: what the requests felt.",
        ),
        p.timeseries(
            "All-reduce time per collective",
            gauge(
                "nccl_collective_time_seconds",
                {"gpu": collective, "size": "Attributes['message_size']"},
                "seconds",
                where=[HOST_FILTER, "Attributes['collective'] = 'AllReduce'"],
                function="max",
            ),
            "s",
            width=8,
            description="Mean all-reduce time per message size, from NCCL Inspector dumps.",
        ),
        p.timeseries(
            "Loss and retransmits",
            port_counters(
                [
                    "rdma_out_of_sequence_total",
                    "rdma_packet_seq_err_total",
                    "rdma_implied_nak_seq_err_total",
                    "rdma_local_ack_timeout_err_total",
                    "rdma_roce_adp_retrans_total",
                    "rdma_symbol_errors_total",
                ],
                "rate",
            ),
            "cps",
            width=8,
            description="Per port: packets out of sequence, sequence-error NAKs, ack timeouts, adaptive "
            "retransmits, symbol errors. Ack timeouts on every port of a host while its "
            "traffic stops: a peer of the TP group is gone.",
        ),
        p.timeseries(
            "Congestion",
            port_counters(
                ["rdma_np_ecn_marked_roce_packets_total", "rdma_np_cnp_sent_total", "rdma_rp_cnp_handled_total"], "rate"
            ),
            "pps",
            width=12,
            description="Per port: ECN-marked packets received, CNPs sent in answer, CNPs the sender "
            "handled (RoCE congestion control slowing down).",
        ),
        p.timeseries(
            "PFC time paused per priority",
            counter(
                "nic_pfc_pause_duration_seconds_total",
                {"netdev": NETDEV, "direction": "Attributes['direction']", "priority": "Attributes['priority']"},
                "paused",
                where=[HOST_FILTER],
            ),
            "percentunit",
            max_value=1,
            width=12,
            description="Share of time each netdev was paused (rx: the switch paused it) per priority.",
        ),
    ]


def tp_panels() -> list[dict]:
    last_scraped = (
        f"SELECT {HOST} AS host, max(TimeUnix) AS last_scraped FROM otel_metrics_gauge "
        "WHERE MetricName = 'stagetrace_collector_success' AND TimeUnix <= $__toTime GROUP BY host"
    )
    return [
        p.row("Tensor-parallel groups"),
        p.timeseries(
            "Requests missing TP ranks",
            aggregate(
                f"(SELECT *, arrayJoin(HostList) AS Host FROM {TP_REQUESTS})",
                "RequestStart",
                {"missing": MISSING_RANKS_RATIO},
                labels={"host": "Host"},
                where=["TpSize > 1", any_selected("Host", "host")],
            ),
            "percentunit",
            max_value=1,
            width=12,
            description="Per host taking part in tensor-parallel all-reduces: the share of its requests with "
            "fewer rank spans than parallel.tp_size. When a host of a TP group fails mid-run, "
            "the other hosts' requests lose its ranks (the alert names the group).",
        ),
        p.table(
            "TP hosts, last seen",
            "SELECT s.host AS host, s.last_seen AS last_seen, m.last_scraped AS last_scraped, s.ranks AS ranks, "
            "s.rank_spans AS rank_spans FROM (SELECT HostName AS host, max(Start) AS last_seen, "
            "arrayStringConcat(arraySort(groupUniqArray(Rank)), ' ') AS ranks, count() AS rank_spans "
            f"FROM {STAGES} WHERE Stage = 'allreduce' AND Rank != '' AND $__timeFilter(Start) "
            f"AND {any_selected('HostName', 'host')} GROUP BY host) AS s LEFT JOIN ({last_scraped}) AS m "
            "ON s.host = m.host ORDER BY last_seen",
            "none",
            width=12,
            overrides=[p.override("last_seen", unit="dateTimeAsIso"), p.override("last_scraped", unit="dateTimeAsIso")],
            description="Every host that ran all-reduce ranks in the time range: the last moment one of its rank "
            "spans started, and its agent's last scrape. The host of a degraded group is the one "
            "last seen earliest.",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: Fabric",
        "Rails (throughput, utilisation, balance, links below their peers), loss and congestion beside the all-reduce "
        "time per request and per collective, and the health of tensor-parallel groups across hosts.",
        [*rail_panels(), *loss_panels(), *tp_panels()],
        variables(),
    )
