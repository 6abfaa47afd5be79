"""The demo's fabric and weights: half an hour of a cluster's RDMA fabric, played on a clock of its own.

The pipeline's faults play out in a few minutes of its simulated clock; the fabric's (a link that renegotiates, a
host that drops out of its tensor-parallel group, a weight sync a GPU misses) only mean something over scrape
intervals. So this part of the demo plays ``DURATION_S`` seconds ending where the pipeline's requests begin, scraped
every ``SCRAPE_S`` seconds: each host has a sysfs tree in the ``/sys/class/infiniband`` layout, ethtool statistics and
NCCL Inspector dumps in their recorded formats, read by the real ``rdma``, ``ethtool`` and ``nccl`` collectors;
its spans are made with the OpenTelemetry SDK under each host's own resource. Three groups of hosts:

- ``tp-node-1`` and ``tp-node-2`` serve one model with TP=16 (8 GPUs each) over two rails, ``mlx5_0`` and
  ``mlx5_1``, wired NIC to NIC at 400 Gb/s. From ``RAIL_DEGRADED`` the rail-1 link renegotiates at 100 Gb/s and
  drops packets: NCCL still splits the bytes evenly, so the rails stay balanced, but the all-reduce runs at the
  slow rail's speed and takes retransmits. From ``NODE_DOWN`` ``tp-node-2`` stops: no scrapes, and the group's
  requests carry only ``tp-node-1``'s rank spans, and fail; then it comes back.
- ``train-node-1`` and ``train-node-2`` (8 training ranks, one 400 Gb/s NIC each) push every step's weights
  (``WEIGHT_BYTES``) into the four ``rollout-node-*`` GPUs (one 200 Gb/s NIC each) every ``SYNC_EVERY_S``. The
  first ``RANK0_SYNCS`` syncs go through training rank 0, which writes all the weights to every GPU (fan-in on
  one NIC); the rest go all to all, each rank writing its shard. ``rollout-node-3`` misses the sync of step
  ``MISSED_STEP`` (its links fail) and serves the previous step until the next one.
- the rollout GPUs sample RL rollouts (temperature 1, no seed: outputs differ by design) with the step they hold.

Every fault is written to ``stagetrace_demo_fabric`` as ground truth (kind, host, device, start, end, step).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

from stagetrace import conventions as cv
from stagetrace.collectors import build_node
from stagetrace.collectors.base import Options
from stagetrace.demo.hardware import port_files
from stagetrace.digest import digest
from stagetrace.exporters.rows import Resources, node_metric_rows, span_row

TRUTH_TABLE = "stagetrace_demo_fabric"
DURATION_S = 1800
SCRAPE_S = 15
S = 1_000_000_000  # ns per second
GB = 1_000_000_000

TP_HOSTS = ("tp-node-1", "tp-node-2")
TP_SIZE, GPUS_PER_TP_HOST = 16, 8
TP_SERVICE = "tp16-serve"
TP_REQUEST_EVERY_S = 10
RAIL_DEVICES = ("mlx5_0", "mlx5_1")
RAIL_BYTES_PER_S = 12 * GB  # what each rail carries each way while the group is healthy
ALLREDUCE_MS = 2.0  # the all-reduce time of a request while healthy
RAIL_DEGRADED = (360, 720)  # seconds into the scenario: rail 1 runs at 100 Gb/s and drops packets
NODE_DOWN = (990, 1260)  # tp-node-2 stops reporting, then comes back

TRAIN_HOSTS = ("train-node-1", "train-node-2")
TRAIN_RANKS = 8  # one GPU and NIC (mlx5_<rank % 4>) each, four per host
ROLLOUT_HOSTS = tuple(f"rollout-node-{i}" for i in range(1, 5))
TRAIN_SERVICE, ROLLOUT_SERVICE = "rl-trainer", "rl-rollout"
WEIGHT_BYTES = 16 * GB  # one step's weights, as every rollout GPU holds them whole
FIRST_STEP = 500  # the step the rollout GPUs hold when the scenario starts
SYNC_EVERY_S, FIRST_SYNC_S = 180, 60
RANK0_SYNCS = 5  # the first syncs funnel through training rank 0; the rest go all to all
MISSED_STEP, MISSING_HOST = 507, "rollout-node-3"
ROLLOUT_EVERY_S = 10
TRAIN_NIC_BYTES_PER_S, ROLLOUT_NIC_BYTES_PER_S = 50 * GB, 25 * GB  # 400 and 200 Gb/s


@dataclass
class Event:
    kind: str  # rail_degraded | node_down | weights_sync | weights_missed
    host: str
    device: str
    start_s: float
    end_s: float
    step: int = 0
    detail: str = ""


@dataclass
class Port:
    device: str
    rate: str  # the sysfs text
    netdev: str
    counters: dict = field(default_factory=dict)
    hw: dict = field(default_factory=dict)
    pause: dict = field(default_factory=dict)  # ethtool: rx/tx_prio3_pause and _pause_duration


_FULL, _HALF, _SLOW = "400 Gb/sec (4X NDR)", "200 Gb/sec (4X HDR)", "100 Gb/sec (4X EDR)"
_PORT_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "symbol_error")
_HW_COUNTERS = (
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "roce_adp_retrans",
    "np_cnp_sent",
    "rp_cnp_handled",
    "np_ecn_marked_roce_packets",
)
_PAUSE = ("rx_prio3_pause", "rx_prio3_pause_duration", "tx_prio3_pause", "tx_prio3_pause_duration")


class Host:
    """One host's NICs (sysfs, ethtool) and NCCL dumps, scraped by the real collectors."""

    def __init__(self, name: str, root: Path, devices: tuple[str, ...], rate: str, nccl: bool = False):
        self.name = name
        self.root = root / name
        self.ports = {
            d: Port(
                d,
                rate,
                f"eth{i}",
                dict.fromkeys(_PORT_COUNTERS, 0),
                dict.fromkeys(_HW_COUNTERS, 0),
                dict.fromkeys(_PAUSE, 0),
            )
            for i, d in enumerate(devices)
        }
        self.collective_us: float | None = None  # NCCL Inspector's mean all-reduce time over the last interval
        self._written: dict[Path, str] = {}
        self._dump = self.root / "nccl" / f"nccl_inspector_metrics_{_uuid(digest([name, 0]))[4:]}.prom"
        collectors = ["rdma", "ethtool"] + (["nccl"] if nccl else [])
        (self.root / "nccl").mkdir(parents=True)
        self._node = build_node(
            collectors,
            Options(
                host=name,
                sysfs=self.root / "sys",
                ethtool_fixture=self.root / "ethtool.json",
                nccl_dir=self.root / "nccl",
            ),
        )

    def move(self, device: str, transmit: float, receive: float) -> None:
        counters = self.ports[device].counters
        counters["port_xmit_data"] += int(transmit) // 4  # the kernel counts 4-byte words
        counters["port_rcv_data"] += int(receive) // 4
        counters["port_xmit_packets"] += int(transmit) // 4096
        counters["port_rcv_packets"] += int(receive) // 4096

    def sample(self, at_ns: int, start_ns: int) -> dict[str, list[tuple]]:
        self._write()
        return node_metric_rows(self._node.collect(), self.name, at_ns, start_ns=start_ns)

    def _write(self) -> None:
        """The files whose text changed since the last scrape (a write costs more than the collector's read)."""
        files = {}
        for port in self.ports.values():
            files |= port_files(self.root / "sys", port.device, port.rate, port.netdev, port.counters, port.hw)
        files[self.root / "ethtool.json"] = json.dumps({p.netdev: p.pause for p in self.ports.values()})
        if self.collective_us is not None:
            labels = (
                f'node="{self.name}",gpu="GPU0",comm_name="tp_group",n_nodes="2",nranks="{TP_SIZE}",'
                'collective="AllReduce",message_size="64-65KB",algo_proto="Ring_LL"'
            )
            files[self._dump] = f"nccl_collective_exec_time_microseconds{{{labels}}} {self.collective_us}"
        elif self._dump.exists():  # the job's dumps go when it stops
            self._dump.unlink()
            self._written.pop(self._dump, None)
        for path, text in files.items():
            if self._written.get(path) != text:
                if path not in self._written:
                    path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text + "\n")
                self._written[path] = text

    def close(self) -> None:
        self._node.close()


class _Rows(SpanExporter):
    def __init__(self):
        self.rows: list[tuple] = []
        self._resources = Resources()

    def export(self, spans) -> SpanExportResult:
        self.rows.extend(span_row(s, self._resources) for s in spans)
        return SpanExportResult.SUCCESS


class Scenario:
    def __init__(self, end_ns: int, seed: int):
        self.t0 = end_ns - DURATION_S * S
        self.seed = seed
        self.spans = _Rows()
        self._tracers: dict[tuple[str, str], trace.Tracer] = {}
        self._providers: list[TracerProvider] = []
        self.truth: list[Event] = []
        self._dir = Path(tempfile.mkdtemp(prefix="stagetrace-demo-fabric-"))
        self.tp = {h: Host(h, self._dir, RAIL_DEVICES, _FULL, nccl=True) for h in TP_HOSTS}
        self.train = {h: Host(h, self._dir, tuple(f"mlx5_{i}" for i in range(4)), _FULL) for h in TRAIN_HOSTS}
        self.rollout = {h: Host(h, self._dir, ("mlx5_0",), _HALF) for h in ROLLOUT_HOSTS}
        self.gpu_uuid = {h: _uuid(digest([seed, h, 0])) for h in ROLLOUT_HOSTS}
        self.step = dict.fromkeys(ROLLOUT_HOSTS, FIRST_STEP)

    def ns(self, seconds: float) -> int:
        return self.t0 + int(seconds * S)

    def tracer(self, service: str, host: str) -> trace.Tracer:
        if (service, host) not in self._tracers:
            provider = TracerProvider(resource=Resource.create({"service.name": service, "host.name": host}))
            provider.add_span_processor(SimpleSpanProcessor(self.spans))
            self._providers.append(provider)
            self._tracers[(service, host)] = provider.get_tracer("stagetrace.demo")
        return self._tracers[(service, host)]

    # -- the timeline
    def play(self) -> dict[str, list[tuple]]:
        metrics: dict[str, list[tuple]] = {}
        syncs = [FIRST_SYNC_S + k * SYNC_EVERY_S for k in range(DURATION_S // SYNC_EVERY_S)]
        self.truth.append(Event("rail_degraded", TP_HOSTS[0], RAIL_DEVICES[1], *RAIL_DEGRADED, detail="100 Gb/sec"))
        self.truth.append(Event("rail_degraded", TP_HOSTS[1], RAIL_DEVICES[1], *RAIL_DEGRADED, detail="100 Gb/sec"))
        self.truth.append(Event("node_down", TP_HOSTS[1], "", *NODE_DOWN))
        for tick in range(0, DURATION_S + 1, SCRAPE_S):
            for second in range(tick - SCRAPE_S + 1, tick + 1) if tick else ():
                self._second(second, syncs)
            for host in [*self.tp.values(), *self.train.values(), *self.rollout.values()]:
                if host.name == TP_HOSTS[1] and _within(tick, NODE_DOWN):
                    continue  # no scrape answers from a host that is down
                for table, rows in host.sample(self.ns(tick), self.t0).items():
                    metrics.setdefault(table, []).extend(rows)
        for provider in self._providers:
            provider.shutdown()
        return metrics

    def _second(self, second: int, syncs: list[int]) -> None:
        down, degraded = _within(second, NODE_DOWN), _within(second, RAIL_DEGRADED)
        if degraded and second == RAIL_DEGRADED[0]:
            for host in self.tp.values():
                host.ports[RAIL_DEVICES[1]].rate = _SLOW
        if second == RAIL_DEGRADED[1]:
            for host in self.tp.values():
                host.ports[RAIL_DEVICES[1]].rate = _FULL
        # the TP group's traffic: even over the rails, at the slow rail's pace while it is degraded
        share = 0.0 if down else 0.25 if degraded else 1.0
        for host in self.tp.values():
            if host.name == TP_HOSTS[1] and down:
                continue
            for device in RAIL_DEVICES:
                host.move(device, RAIL_BYTES_PER_S * share, RAIL_BYTES_PER_S * share)
            if degraded:  # the slow link drops packets: sequence errors at the receiver, resends at the sender
                rail = host.ports[RAIL_DEVICES[1]]
                rail.counters["symbol_error"] += 40
                rail.hw["out_of_sequence"] += 6
                rail.hw["packet_seq_err"] += 6
                rail.hw["roce_adp_retrans"] += 6
                rail.hw["np_ecn_marked_roce_packets"] += 900
                rail.hw["np_cnp_sent"] += 300
                rail.hw["rp_cnp_handled"] += 300
                rail.pause["rx_prio3_pause"] += 120
                rail.pause["rx_prio3_pause_duration"] += 30_000  # µs of every second: paused 3% of the time
            if down:  # the peer is gone: the QPs' ack timers fire
                for device in RAIL_DEVICES:
                    host.ports[device].hw["local_ack_timeout_err"] += 2
            host.collective_us = None if down else 42.5 * (4.0 if degraded else 1.0)
        if second % TP_REQUEST_EVERY_S == 0:
            self._tp_request(second, down, degraded)
        if second in syncs:
            self._sync(syncs.index(second), second)
        if second % ROLLOUT_EVERY_S == 5:
            for host in ROLLOUT_HOSTS:
                self._rollout(host, second)

    def _tp_request(self, second: int, down: bool, degraded: bool) -> None:
        start = self.ns(second)
        allreduce_ms = ALLREDUCE_MS * (4.0 if degraded else 1.0)
        root = self.tracer(TP_SERVICE, TP_HOSTS[0]).start_span(
            "inference.request",
            kind=trace.SpanKind.SERVER,
            start_time=start,
            attributes={
                cv.REQUEST_ID: f"tp-{digest([self.seed, 'tp', second])[:12]}",
                "gen_ai.request.model": "demo-405b",
                "gen_ai.request.temperature": 0.0,
                "gen_ai.request.seed": 7,
            },
        )
        context = trace.set_span_in_context(root)
        for rank in range(TP_SIZE):
            host = TP_HOSTS[rank // GPUS_PER_TP_HOST]
            if down and host == TP_HOSTS[1]:
                continue
            span = self.tracer(TP_SERVICE, host).start_span(
                "stage.allreduce",
                context=context,
                start_time=start + 1_000_000,
                attributes={
                    cv.STAGE: "allreduce",
                    cv.TP_RANK: str(rank),
                    cv.TP_SIZE: TP_SIZE,
                    "allreduce.algorithm": "ring",
                    "allreduce.time_ms": allreduce_ms,
                    "net.rdma.devices": list(RAIL_DEVICES),
                },
            )
            if down:
                span.set_status(Status(StatusCode.ERROR, "NCCL watchdog: collective timed out"))
            span.end(end_time=start + 1_000_000 + int(allreduce_ms * 1e6))
        if down:
            root.set_status(Status(StatusCode.ERROR, "tensor-parallel group lost ranks 8-15"))
        root.end(end_time=start + 30_000_000)

    def _sync(self, k: int, second: int) -> None:
        step = FIRST_STEP + 1 + k
        rank0 = k < RANK0_SYNCS
        links = []  # (source rank, destination host, bytes)
        for host in ROLLOUT_HOSTS:
            if rank0:
                links.append((0, host, WEIGHT_BYTES))
            else:
                links += [(rank, host, WEIGHT_BYTES // TRAIN_RANKS) for rank in range(TRAIN_RANKS)]
        # the busiest NIC sets the pace: rank 0's for the fan-in, each GPU's own otherwise
        seconds = max(
            len(ROLLOUT_HOSTS) * WEIGHT_BYTES / TRAIN_NIC_BYTES_PER_S if rank0 else 0.0,
            WEIGHT_BYTES / ROLLOUT_NIC_BYTES_PER_S,
        )
        start, end = self.ns(second), self.ns(second + seconds)
        missed = step == MISSED_STEP
        sync = self.tracer(TRAIN_SERVICE, TRAIN_HOSTS[0]).start_span(
            "weights.sync",
            start_time=start,
            attributes={
                cv.WEIGHTS_STEP: step,
                cv.SYNC_BYTES: sum(b for *_, b in links),
                cv.SYNC_SOURCE_RANKS: TRAIN_RANKS,
                cv.SYNC_DESTINATION_RANKS: len(ROLLOUT_HOSTS),
            },
        )
        context = trace.set_span_in_context(sync)
        failed = 0
        for rank, host, size in links:
            source_host, source_nic = TRAIN_HOSTS[rank // 4], f"mlx5_{rank % 4}"
            lost = missed and host == MISSING_HOST
            span = self.tracer(TRAIN_SERVICE, source_host).start_span(
                "weights.write",
                context=context,
                start_time=start,
                attributes={
                    cv.LINK_BYTES: 0 if lost else size,
                    cv.LINK_SOURCE_HOST: source_host,
                    cv.LINK_SOURCE_RANK: rank,
                    cv.LINK_SOURCE_DEVICE: source_nic,
                    cv.LINK_DESTINATION_HOST: host,
                    cv.LINK_DESTINATION_RANK: ROLLOUT_HOSTS.index(host),
                    cv.LINK_DESTINATION_DEVICE: "mlx5_0",
                    cv.LINK_DESTINATION_GPU: self.gpu_uuid[host],
                },
            )
            if lost:
                failed += size
                span.set_status(Status(StatusCode.ERROR, "transport retries exceeded (IBV_WC_RETRY_EXC_ERR)"))
            else:
                self.train[source_host].move(source_nic, size, 0)
                self.rollout[host].move("mlx5_0", 0, size)
            span.end(end_time=end)
        if failed:
            sync.set_status(Status(StatusCode.ERROR, f"{MISSING_HOST} did not receive step {step}"))
        sync.set_attribute(cv.SYNC_BYTES, sum(b for *_, b in links) - failed)
        sync.end(end_time=end)
        for host in ROLLOUT_HOSTS:
            if not (missed and host == MISSING_HOST):
                self.step[host] = step
        self.truth.append(
            Event(
                "weights_sync", TRAIN_HOSTS[0], "", second, second + seconds, step, "rank0" if rank0 else "all_to_all"
            )
        )
        if missed:
            self.truth.append(
                Event("weights_missed", MISSING_HOST, self.gpu_uuid[MISSING_HOST], second, second + SYNC_EVERY_S, step)
            )

    def _rollout(self, host: str, second: int) -> None:
        start = self.ns(second)
        tracer = self.tracer(ROLLOUT_SERVICE, host)
        root = tracer.start_span(
            "rollout.request",
            kind=trace.SpanKind.SERVER,
            start_time=start,
            attributes={
                cv.REQUEST_ID: f"rl-{digest([self.seed, host, second])[:12]}",
                "gen_ai.request.model": "policy",
                "gen_ai.request.temperature": 1.0,
            },
        )
        decode = tracer.start_span(
            "stage.decode",
            context=trace.set_span_in_context(root),
            start_time=start + 2_000_000,
            attributes={
                cv.STAGE: "decode",
                cv.GPU_UUID: self.gpu_uuid[host],
                cv.WEIGHTS_STEP: self.step[host],
                "decode.tokens": 512,
            },
        )
        decode.end(end_time=start + 800_000_000)
        root.end(end_time=start + 805_000_000)

    def close(self) -> None:
        for host in [*self.tp.values(), *self.train.values(), *self.rollout.values()]:
            host.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _within(second: float, window: tuple[float, float]) -> bool:
    return window[0] <= second < window[1]


def _uuid(hex_digest: str) -> str:
    return f"GPU-{hex_digest[:8]}-{hex_digest[8:12]}-{hex_digest[12:16]}-{hex_digest[16:20]}-{hex_digest[20:32]}"


def play(end_ns: int, seed: int) -> tuple[list[tuple], dict[str, list[tuple]], list[Event], int]:
    """The scenario's span rows, metric rows by table, ground truth, and its start (ns)."""
    scenario = Scenario(end_ns, seed)
    try:
        metrics = scenario.play()
    finally:
        scenario.close()
    return scenario.spans.rows, metrics, scenario.truth, scenario.t0


def write_truth(store, events: list[Event], t0_ns: int, run: str = "") -> None:
    """The scenario's ground truth, each row with the demo run that wrote it (``demo.RUNS_TABLE``)."""
    store.client.command(
        f"CREATE TABLE IF NOT EXISTS {{db:Identifier}}.{TRUTH_TABLE} (Kind LowCardinality(String), Host String, "
        "Device String, Start DateTime64(9), End DateTime64(9), Step Int64, Detail String, Run String) "
        "ENGINE = MergeTree ORDER BY (Kind, Start)",
        parameters={"db": store.database},
    )
    store.client.command(
        f"ALTER TABLE {{db:Identifier}}.{TRUTH_TABLE} ADD COLUMN IF NOT EXISTS Run String",
        parameters={"db": store.database},
    )  # an older demo's table lacks it
    rows = [
        (e.kind, e.host, e.device, t0_ns + int(e.start_s * S), t0_ns + int(e.end_s * S), e.step, e.detail, run)
        for e in events
    ]
    store.client.insert(
        TRUTH_TABLE,
        rows,
        column_names=("Kind", "Host", "Device", "Start", "End", "Step", "Detail", "Run"),
        database=store.database,
    )
