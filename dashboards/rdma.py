"""RDMA ports: per-port throughput, congestion, retransmits and timeouts, link state, PFC, NCCL bus bandwidth.

RDMA series are per (host, device, port); ethtool's PFC series are per netdev and are matched to the
selected RDMA devices through ``rdma_port_info``'s netdev label.
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import HOST, NETDEV, NIC_PORT, SHORT_NAME, any_selected, counter, gauge

UID = "stagetrace-rdma"

HOST_FILTER = any_selected(HOST, "host")
PORT_FILTERS = [HOST_FILTER, any_selected("Attributes['device']", "nic")]
# the netdevs behind the selected RDMA devices, on the same host
NETDEV_FILTERS = [
    HOST_FILTER,
    "$__conditionalAll((ResourceAttributes['host.name'], Attributes['netdev']) IN ("
    "SELECT ResourceAttributes['host.name'], Attributes['netdev'] FROM otel_metrics_gauge "
    "WHERE MetricName = 'rdma_port_info' AND $__timeFilter(TimeUnix) "
    "AND Attributes['device'] IN (${nic:singlequote})), $nic)",
]
BY_PORT = {"port": NIC_PORT}


def port_counter(metrics: str | list[str], value: str, **options) -> str:
    labels = BY_PORT if isinstance(metrics, str) else {**BY_PORT, "counter": SHORT_NAME}
    return counter(metrics, labels, value, where=PORT_FILTERS, **options)


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.query_variable(
            "host",
            "Host",
            f"SELECT DISTINCT {HOST} AS host FROM otel_metrics_gauge "
            "WHERE MetricName = 'rdma_port_state' AND $__timeFilter(TimeUnix) ORDER BY host",
        ),
        p.query_variable(
            "nic",
            "NIC",
            "SELECT DISTINCT Attributes['device'] AS device FROM otel_metrics_gauge "
            f"WHERE MetricName = 'rdma_port_state' AND $__timeFilter(TimeUnix) AND {HOST_FILTER} "
            "ORDER BY device",
            description="RDMA device (e.g. mlx5_0); PFC panels show the netdevs behind it.",
        ),
    ]


def panels() -> list[dict]:
    direction = "if(MetricName LIKE '%transmit%', 'transmit', 'receive')"
    return [
        p.row("Throughput and link"),
        p.timeseries(
            "Port throughput",
            counter(
                ["rdma_port_transmit_bytes_total", "rdma_port_receive_bytes_total"],
                {**BY_PORT, "direction": direction},
                "throughput",
                where=PORT_FILTERS,
            ),
            "Bps",
            description="Data bytes per second per port (the kernel's 4-byte words, times 4).",
        ),
        p.timeseries(
            "Link rate",
            gauge("rdma_port_rate_bytes_per_second", BY_PORT, "rate", where=PORT_FILTERS),
            "Bps",
            description="Link data rate (active width x speed): the ceiling for the throughput panel.",
        ),
        p.timeseries(
            "Port state",
            gauge("rdma_port_state", BY_PORT, "state", where=PORT_FILTERS, function="min"),
            "none",
            max_value=5,
            description="Logical port state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.",
        ),
        p.timeseries(
            "Link downs per interval",
            port_counter(["rdma_link_downed_total", "rdma_link_error_recovery_total"], "events", per_second=False),
            "short",
            bars=True,
            description="Times the link went down (error recovery failed) or recovered from errors.",
        ),
        p.row("Congestion and loss"),
        p.timeseries(
            "Congestion notifications",
            port_counter(
                ["rdma_np_cnp_sent_total", "rdma_rp_cnp_handled_total", "rdma_np_ecn_marked_roce_packets_total"], "rate"
            ),
            "pps",
            description="ECN-marked packets received, CNPs sent in answer, CNPs handled by the "
            "sender's reaction point: congestion on the path (RoCE DCQCN).",
        ),
        p.timeseries(
            "Retransmits and ack timeouts",
            port_counter(
                [
                    "rdma_local_ack_timeout_err_total",
                    "rdma_roce_adp_retrans_total",
                    "rdma_roce_adp_retrans_to_total",
                    "rdma_duplicate_request_total",
                ],
                "rate",
            ),
            "cps",
            description="Ack timeouts (a QP's retransmission timer fired), adaptive retransmissions "
            "and duplicate requests: each one stalls an all-reduce.",
        ),
        p.timeseries(
            "Sequence errors",
            port_counter(
                ["rdma_out_of_sequence_total", "rdma_packet_seq_err_total", "rdma_implied_nak_seq_err_total"], "rate"
            ),
            "cps",
            description="Out-of-sequence packets and sequence-error NAKs: packet loss on the path.",
        ),
        p.timeseries(
            "Transmit wait",
            port_counter("rdma_port_transmit_wait_total", "ticks"),
            "short",
            description="Ticks per second the port had data to send but could not (back-pressure).",
        ),
        p.row("PFC"),
        p.timeseries(
            "PFC pause frames",
            counter(
                "nic_pfc_pause_frames_total",
                {"netdev": NETDEV, "direction": "Attributes['direction']", "priority": "Attributes['priority']"},
                "frames",
                where=NETDEV_FILTERS,
            ),
            "pps",
            description="Pause frames per second per priority (global: link-level pause). rx: the "
            "peer paused this port; tx: this port paused the peer.",
        ),
        p.timeseries(
            "Time paused",
            counter(
                "nic_pfc_pause_duration_seconds_total",
                {"netdev": NETDEV, "direction": "Attributes['direction']", "priority": "Attributes['priority']"},
                "paused",
                where=NETDEV_FILTERS,
            ),
            "percentunit",
            max_value=1,
            description="Share of time paused per priority: near 100% is a pause storm.",
        ),
        p.timeseries(
            "Pause storms and discards",
            counter(
                ["nic_pause_storm_events_total", "nic_discards_total", "nic_out_of_buffer_total"],
                {"netdev": NETDEV, "counter": SHORT_NAME},
                "events",
                where=NETDEV_FILTERS,
                per_second=False,
            ),
            "short",
            bars=True,
            width=24,
            description="Pause-storm events the driver detected, packets dropped for lack of buffers.",
        ),
        p.row("NCCL"),
        p.timeseries(
            "NCCL all-reduce bus bandwidth",
            gauge(
                "nccl_collective_bus_bandwidth_bytes_per_second",
                {
                    "gpu": "concat(ResourceAttributes['host.name'], ' CUDA ', Attributes['cuda_device'])",
                    "size": "Attributes['message_size']",
                },
                "bandwidth",
                where=[HOST_FILTER, "Attributes['collective'] = 'AllReduce'"],
            ),
            "Bps",
            width=24,
            description="Bus bandwidth of all-reduce per message size (NCCL Inspector); "
            "its time beside the fabric's counters is on the Fabric dashboard.",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: RDMA fabric",
        "Per NIC port: throughput, congestion (CNP, ECN), retransmits and ack timeouts, sequence errors, link downs, "
        "PFC pause frames and time per priority, NCCL all-reduce bus bandwidth.",
        panels(),
        variables(),
    )
