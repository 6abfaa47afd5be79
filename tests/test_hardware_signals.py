"""Hardware signals against a real embedded store: PFC pause storms, NCCL slowdowns, and what the query reads.

Samples are written in the agent's layout (counters to ``otel_metrics_sum``, gauges and info metrics
to ``otel_metrics_gauge``) on a regular scrape grid, and a stage runs inside one scrape interval.
nic_* series are per netdev, as the ethtool collector writes them; ``rdma_port_info`` maps the netdev to
the RDMA device that spans name in ``net.rdma.devices``.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from stagetrace.analysis.hardware import GPU, NIC, SIGNALS, Samples, Signal
from stagetrace.exporters.clickhouse import METRIC_COLUMNS, SUM_COLUMNS

S = 1_000_000_000
INTERVAL = 15 * S
SCRAPES = 41  # ten minutes of scrapes
STAGE_AT = 20  # the stage runs inside the interval after this scrape
T0 = (time.time_ns() // INTERVAL) * INTERVAL - 3600 * S


def at(i: int) -> int:
    return T0 + i * INTERVAL


STAGE = (at(STAGE_AT) + 2 * S, at(STAGE_AT) + 10 * S)
# the scrapes whose intervals the stage's window covers: one of margin before the stage's, and the stage's own
IN_WINDOW = {STAGE_AT - 1, STAGE_AT}


def write(store, host: str, name: str, labels: dict, values: dict[int, float], gauge: bool = False) -> None:
    """One series: ``values`` maps scrape index to value."""
    rows = []
    for i, value in sorted(values.items()):
        row = (
            {"host.name": host},
            "stagetrace-agent",
            "stagetrace.collectors",
            "",
            name,
            "",
            "",
            labels,
            0 if gauge else T0 - INTERVAL,
            at(i),
            float(value),
        )
        rows.append(row if gauge else (*row, 2, True))
    table, columns = ("otel_metrics_gauge", METRIC_COLUMNS) if gauge else ("otel_metrics_sum", SUM_COLUMNS)
    store.client.insert(table, rows, column_names=columns, database=store.database)


def node(store, host: str = "node-a", ports: dict[str, str] | None = None) -> None:
    """A host's scrapes: its RDMA ports (device -> netdev, as ``rdma_port_info`` says) and a byte counter."""
    ports = {"mlx5_0": "eth0"} if ports is None else ports
    for device, netdev in ports.items():
        labels = {"device": device, "port": "1"}
        write(store, host, "rdma_port_transmit_bytes_total", labels, {i: i * 10**9 for i in range(SCRAPES)})
        write(
            store,
            host,
            "rdma_port_info",
            {**labels, "netdev": netdev, "link_layer": "Ethernet"},
            {i: 1 for i in range(SCRAPES)},
            gauge=True,
        )


def cumulative(rate_per_s, seed: int = 0, jitter: float = 0.3, start: float = 10**6) -> dict[int, float]:
    """A counter whose per-second rate over the interval ending at scrape i+1 is ``rate_per_s(i)`` ± jitter."""
    rng = random.Random(seed)
    value, out = start, {0: start}
    for i in range(SCRAPES - 1):
        value += rate_per_s(i) * (1 + rng.uniform(-jitter, jitter)) * INTERVAL / S
        out[i + 1] = round(value)
    return out


def window_increase(values: dict[int, float]) -> float:
    return sum(values[i + 1] - values[i] for i in IN_WINDOW)


def pfc(direction: str = "rx", priority: str = "3", netdev: str = "eth0") -> dict:
    return {"netdev": netdev, "direction": direction, "priority": priority}


def rises(store, nics=(), gpus=(), host: str = "node-a", signals=None):
    samples = Samples(store, [host], at(0), at(SCRAPES - 1), signals=signals)
    return samples.rises(host, list(gpus), list(nics), *STAGE)


NORMAL_PAUSES = 50  # frames/s: the usual pausing of a loaded lossless fabric
STORM = 40  # times the usual rate while the stage ran


def test_pfc_storm_on_the_netdev_rises_for_the_span_naming_its_rdma_device(store):
    node(store)
    storm = cumulative(lambda i: NORMAL_PAUSES * (STORM if i in IN_WINDOW else 1))
    write(store, "node-a", "nic_pfc_pause_frames_total", pfc(), storm)
    [rise] = rises(store, nics=["mlx5_0"])
    assert (rise.metric, rise.device, rise.labels["netdev"]) == ("nic_pfc_pause_frames_total", "mlx5_0", "eth0")
    assert rise.delta == window_increase(storm)
    assert rise.typical is not None and rise.delta > 10 * rise.typical, "typical: the usual increase over as long"
    assert rises(store, nics=["eth0"]) == [], "the netdev is mlx5_0's: a span names the RDMA device"
    # the window weighed: a scrape before the stage's to the one after it; the storm rose over both its intervals
    assert rise.timing.window_ns == (at(STAGE_AT - 1), at(STAGE_AT + 1)) and rise.timing.stage_ns == STAGE
    assert rise.timing.rise_ns == (at(STAGE_AT - 1), at(STAGE_AT + 1))
    assert rise.timing.words("allreduce") == "between 17 s before allreduce started and 5 s after it ended"


def test_a_rise_s_timing_says_where_in_the_window_it_happened(store):
    """An uncorrected ECC error two scrapes before the stage (inside its lookback of three), and a link-down seen
    at the scrape after it: each Rise carries its own window (the ECC's reaches three scrapes back, the link's
    one) and when it rose, and says it in words whose numbers bound that time. Neighbour: a link-down on another
    device of the host at the same scrape is not the span's."""
    node(store, ports={"mlx5_0": "eth0", "mlx5_1": "eth1"})
    write(store, "node-a", "gpu_energy_joules_total", {"gpu": "0", "uuid": "GPU-a"}, {i: i for i in range(SCRAPES)})
    write(
        store,
        "node-a",
        "gpu_ecc_errors_total",
        {"gpu": "0", "uuid": "GPU-a", "type": "uncorrected"},
        {i: 0 if i < STAGE_AT - 1 else 1 for i in range(SCRAPES)},
    )
    for device in ("mlx5_0", "mlx5_1"):
        write(
            store,
            "node-a",
            "rdma_link_downed_total",
            {"device": device, "port": "1"},
            {i: 0 if i <= STAGE_AT else 1 for i in range(SCRAPES)},
        )
    found = {r.metric: r for r in rises(store, gpus=["GPU-a"], nics=["mlx5_0"])}
    ecc, link = found["gpu_ecc_errors_total"], found["rdma_link_downed_total"]
    assert ecc.timing.window_ns == (at(STAGE_AT - 3), at(STAGE_AT + 1))
    assert ecc.timing.rise_ns == (at(STAGE_AT - 2), at(STAGE_AT - 1))
    assert ecc.timing.words("decode") == "in the 32 s before decode started"  # 17 s + 15 s, from the scrape before
    assert link.timing.window_ns == (at(STAGE_AT - 1), at(STAGE_AT + 1)) and link.device == "mlx5_0"
    assert link.timing.rise_ns == (at(STAGE_AT), at(STAGE_AT + 1))
    assert link.timing.words("allreduce") == "between 2 s before allreduce started and 5 s after it ended"


def test_without_a_netdev_mapping_the_netdev_name_itself_joins(store):
    node(store, ports={})  # no RDMA port series on the host
    write(store, "node-a", "gpu_energy_joules_total", {"gpu": "0", "uuid": "GPU-a"}, {i: i for i in range(SCRAPES)})
    write(
        store,
        "node-a",
        "nic_pfc_pause_frames_total",
        pfc(),
        cumulative(lambda i: NORMAL_PAUSES * (STORM if i in IN_WINDOW else 1)),
    )
    assert [r.device for r in rises(store, nics=["eth0"])] == ["eth0"]
    assert rises(store, nics=["mlx5_0"]) == []


@pytest.mark.parametrize("rate", [NORMAL_PAUSES, 5_000], ids=["low-rate", "high-but-usual-rate"])
def test_pause_frames_at_their_usual_rate_are_not_a_storm(store, rate):
    node(store)
    for seed, direction in enumerate(("rx", "tx")):
        write(store, "node-a", "nic_pfc_pause_frames_total", pfc(direction), cumulative(lambda i: rate, seed=seed))
        write(
            store,
            "node-a",
            "nic_pfc_pause_duration_seconds_total",
            pfc(direction),
            {i: v * 1e-5 for i, v in cumulative(lambda i: rate, seed=seed).items()},
        )  # 10 µs per frame
    assert rises(store, nics=["mlx5_0"]) == []


def test_a_small_rise_from_no_pausing_is_not_a_storm(store):
    """Usually no pause at all: a few frames during the stage are still below any storm's rate."""
    node(store)
    write(
        store, "node-a", "nic_pfc_pause_frames_total", pfc(), cumulative(lambda i: 2 if i in IN_WINDOW else 0, jitter=0)
    )
    assert rises(store, nics=["mlx5_0"]) == []


def test_paused_time_storm_counts(store):
    node(store)
    # usually paused 0.5 % of the time; while the stage ran, 60 %
    paused = cumulative(lambda i: 0.6 if i in IN_WINDOW else 0.005, start=0.0)
    write(store, "node-a", "nic_pfc_pause_duration_seconds_total", pfc("tx"), paused)
    [rise] = rises(store, nics=["mlx5_0"])
    assert (rise.metric, rise.device) == ("nic_pfc_pause_duration_seconds_total", "mlx5_0")
    assert rise.delta == pytest.approx(window_increase(paused))


def test_pause_storm_events_count_and_rank_above_a_frame_storm(store):
    node(store)
    write(
        store,
        "node-a",
        "nic_pfc_pause_frames_total",
        pfc(),
        cumulative(lambda i: NORMAL_PAUSES * (STORM if i in IN_WINDOW else 1)),
    )
    for level, events in (("error", 2), ("warning", 3)):
        before = STAGE_AT - 1  # the event counter rose in the window: during the stage's interval
        values = {i: (events if i > STAGE_AT else 0) for i in range(SCRAPES)}
        assert values[before] == 0
        write(store, "node-a", "nic_pause_storm_events_total", {"netdev": "eth0", "level": level}, values)
    found = {(r.metric, r.labels.get("level")): r for r in rises(store, nics=["mlx5_0"])}
    error = found[("nic_pause_storm_events_total", "error")]
    warning = found[("nic_pause_storm_events_total", "warning")]
    frames = found[("nic_pfc_pause_frames_total", None)]
    assert (error.delta, warning.delta, error.device) == (2, 3, "mlx5_0")
    assert error.signal.severity > frames.signal.severity, "pause transmission disabled outranks pausing a lot"
    assert error.signal.severity > warning.signal.severity


def test_pause_storm_events_long_before_the_stage_do_not_count(store):
    node(store)
    write(
        store,
        "node-a",
        "nic_pause_storm_events_total",
        {"netdev": "eth0", "level": "error"},
        {i: (1 if i > 5 else 0) for i in range(SCRAPES)},
    )
    assert rises(store, nics=["mlx5_0"]) == []


def test_nic_series_of_another_host_or_another_netdev_do_not_count(store):
    node(store, ports={"mlx5_0": "eth0", "mlx5_1": "eth1"})
    node(store, host="node-b")
    storm = cumulative(lambda i: NORMAL_PAUSES * (STORM if i in IN_WINDOW else 1))
    write(store, "node-a", "nic_pfc_pause_frames_total", pfc(netdev="eth1"), storm)  # mlx5_1's netdev
    write(store, "node-b", "nic_pfc_pause_frames_total", pfc(netdev="eth0"), storm)  # node-b's mlx5_0
    write(
        store,
        "node-b",
        "nic_pause_storm_events_total",
        {"netdev": "eth0", "level": "error"},
        {i: (1 if i > STAGE_AT else 0) for i in range(SCRAPES)},
    )
    assert rises(store, nics=["mlx5_0"]) == []
    # each where it happened
    assert [(r.metric, r.device) for r in rises(store, nics=["mlx5_1"])] == [("nic_pfc_pause_frames_total", "mlx5_1")]
    assert {r.metric for r in rises(store, nics=["mlx5_0"], host="node-b")} == {
        "nic_pfc_pause_frames_total",
        "nic_pause_storm_events_total",
    }


def test_nic_discards_count(store):
    node(store)
    write(
        store,
        "node-a",
        "nic_discards_total",
        {"netdev": "eth0", "direction": "rx"},
        {i: (7 if i > STAGE_AT else 0) for i in range(SCRAPES)},
    )
    [rise] = rises(store, nics=["mlx5_0"])
    assert (rise.metric, rise.device, rise.delta) == ("nic_discards_total", "mlx5_0", 7)


NCCL_USUAL = 0.002  # seconds: a small all-reduce's usual mean time


def nccl(uuid: str = "GPU-a", size: str = "4-5MB") -> dict:
    return {
        "uuid": uuid,
        "cuda_device": "0",
        "node": "node-a",
        "slurm_job_id": "",
        "comm_name": "tp",
        "n_nodes": "2",
        "nranks": "16",
        "collective": "AllReduce",
        "message_size": size,
        "algo_proto": "Ring_ll",
    }


def jittered(usual: float, seed: int = 0, jitter: float = 0.3, slow: float = 1.0) -> dict[int, float]:
    rng = random.Random(seed)
    return {
        i: usual * (1 + rng.uniform(-jitter, jitter)) * (slow if i in IN_WINDOW | {STAGE_AT + 1} else 1)
        for i in range(SCRAPES)
    }


def test_nccl_collective_five_times_its_usual_time_on_the_spans_gpu_counts(store):
    node(store)
    times = jittered(NCCL_USUAL, slow=5)
    write(store, "node-a", "nccl_collective_time_seconds", nccl(), times, gauge=True)
    [rise] = rises(store, gpus=["GPU-a"])
    window = [v for i, v in times.items() if i in IN_WINDOW | {STAGE_AT + 1}]
    usual = [v for i, v in times.items() if i not in IN_WINDOW | {STAGE_AT + 1}]
    assert (rise.metric, rise.device, rise.labels["collective"]) == (
        "nccl_collective_time_seconds",
        "GPU-a",
        "AllReduce",
    )
    assert rise.delta == max(window), "the slow value itself"
    assert rise.typical == pytest.approx(statistics.median(usual))
    assert rises(store, gpus=["GPU-b"]) == []


def test_nccl_collective_usual_jitter_does_not_count(store):
    node(store)
    write(store, "node-a", "nccl_collective_time_seconds", nccl(), jittered(NCCL_USUAL, jitter=0.5), gauge=True)
    # a large all-reduce is slower than a small one, always: that is its own usual time, not a slowdown
    write(store, "node-a", "nccl_collective_time_seconds", nccl(size="4-5GB"), jittered(0.5, seed=1), gauge=True)
    assert rises(store, gpus=["GPU-a"]) == []


def test_nccl_slowdown_on_another_gpu_does_not_count(store):
    node(store)
    write(store, "node-a", "nccl_collective_time_seconds", nccl(), jittered(NCCL_USUAL), gauge=True)
    write(store, "node-a", "nccl_collective_time_seconds", nccl("GPU-b"), jittered(NCCL_USUAL, slow=5), gauge=True)
    assert rises(store, gpus=["GPU-a"]) == []
    assert [r.device for r in rises(store, gpus=["GPU-b"])] == ["GPU-b"]


class Spy:
    """A store whose query results are recorded: what the store handed back is what was read."""

    def __init__(self, store):
        self.database = store.database
        self.client = self
        self._client = store.client
        self.read: list[tuple[str, dict]] = []  # (metric, labels) of every sample returned

    def query(self, sql, parameters=None):
        result = self._client.query(sql, parameters=parameters)
        if "MetricName" in result.column_names:
            name, labels = result.column_names.index("MetricName"), result.column_names.index("Attributes")
            self.read += [(row[name], row[labels]) for row in result.result_rows]
        return result


def busy_host(store) -> None:
    """A host with a bit of everything: signals and the many series that are not."""
    node(store)
    gpu = {"gpu": "0", "uuid": "GPU-a", "model": "H200"}
    write(store, "node-a", "gpu_energy_joules_total", gpu, {i: i for i in range(SCRAPES)})
    write(store, "node-a", "gpu_memory_used_bytes", gpu, {i: 10**9 for i in range(SCRAPES)}, gauge=True)
    write(store, "node-a", "gpu_xid_errors_total", {**gpu, "xid": "48"}, {i: 1 for i in range(STAGE_AT + 1, SCRAPES)})
    for kind in ("corrected", "uncorrected"):
        write(store, "node-a", "gpu_ecc_errors_total", {**gpu, "type": kind}, {i: 0 for i in range(SCRAPES)})
    write(
        store,
        "node-a",
        "rdma_local_ack_timeout_err_total",
        {"device": "mlx5_0", "port": "1"},
        {i: 0 for i in range(SCRAPES)},
    )
    write(store, "node-a", "nic_pfc_pause_frames_total", pfc(), cumulative(lambda i: NORMAL_PAUSES))
    write(store, "node-a", "nic_ethtool_rx_bytes_phy_total", {"netdev": "eth0"}, {i: i for i in range(SCRAPES)})
    write(store, "node-a", "nccl_collective_time_seconds", nccl(), jittered(NCCL_USUAL), gauge=True)
    write(store, "node-a", "nccl_collective_bus_bandwidth_bytes_per_second", nccl(), jittered(1e11), gauge=True)


@pytest.mark.parametrize(
    "signal",
    [
        Signal("gpu_xid_errors_total", GPU, 1.0, lookback=3),
        Signal("gpu_ecc_errors_total", GPU, 0.95, where=(("type", ("uncorrected",)),)),
        Signal("rdma_.*_timeout_.*_total", NIC, 0.9, pattern=True),
        Signal("nccl_collective_time_seconds", GPU, 0.55, gauge=True, ratio_above=3),
    ],
    ids=["name", "name-and-label", "pattern", "gauge"],
)
def test_a_single_signal_reads_only_its_own_series(store, signal):
    busy_host(store)
    spy = Spy(store)
    samples = Samples(spy, ["node-a"], at(0), at(SCRAPES - 1), signals=(signal,))
    assert spy.read, "its series were read"
    assert all(signal.accepts(name, labels) for name, labels in spy.read), sorted({n for n, _ in spy.read})
    samples.rises("node-a", ["GPU-a"], ["mlx5_0"], *STAGE)  # and answers from them


def test_the_signals_read_only_what_some_signal_accepts_and_the_netdev_map(store):
    busy_host(store)
    spy = Spy(store)
    Samples(spy, ["node-a"], at(0), at(SCRAPES - 1))
    names = {name for name, _ in spy.read}
    assert {"gpu_xid_errors_total", "nic_pfc_pause_frames_total", "nccl_collective_time_seconds"} <= names
    strays = {
        name
        for name, labels in spy.read
        if name != "rdma_port_info" and not any(s.accepts(name, labels) for s in SIGNALS)
    }
    assert strays == set()
    assert ("gpu_ecc_errors_total", "corrected") not in {(n, labels.get("type")) for n, labels in spy.read}


def test_windows_are_still_the_hosts_scrapes_when_only_one_signal_is_read(store):
    """The xid series is born inside the window: the host's other series say it was scraped before."""
    busy_host(store)
    signal = Signal("gpu_xid_errors_total", GPU, 1.0, lookback=3)
    [rise] = rises(store, gpus=["GPU-a"], signals=(signal,))
    assert (rise.metric, rise.labels["xid"], rise.delta) == ("gpu_xid_errors_total", "48", 1)


def test_a_nic_signal_alone_reads_its_series_and_the_netdev_map_only(store):
    busy_host(store)
    write(
        store,
        "node-a",
        "nic_pfc_pause_frames_total",
        pfc(direction="tx"),
        cumulative(lambda i: NORMAL_PAUSES * (STORM if i in IN_WINDOW else 1)),
    )
    [signal] = [s for s in SIGNALS if s.metric == "nic_pfc_pause_frames_total"]
    spy = Spy(store)
    samples = Samples(spy, ["node-a"], at(0), at(SCRAPES - 1), signals=(signal,))
    assert {name for name, _ in spy.read} == {"nic_pfc_pause_frames_total", "rdma_port_info"}
    [rise] = samples.rises("node-a", [], ["mlx5_0"], *STAGE)
    assert (rise.device, rise.labels["direction"]) == ("mlx5_0", "tx")
