"""Collection time on the committed fixture node (tests/fixtures/node).

* The RDMA collector on the 8-port sysfs tree against Debian's node_exporter infiniband collector on the
  same tree, each timed by itself (``stagetrace_collector_duration_seconds`` against node_exporter's
  ``node_scrape_collector_duration_seconds{collector="infiniband"}``), median over the scrapes; and once
  more without ``hw_counters/``, which node_exporter before 1.6 does not read, for the same files read.
* One whole-node snapshot of every collector that exists, in-process and as a ``collect --once`` process.
* The gpu collector's scrape at a 1 s interval on 8 H200s replaying the recorded GPM series (h200-gpm), with GPM
  on, beside the same GPUs answering that they have no GPM (what the collector read before GPM): the cost of one
  ``nvmlGpmSampleGet`` and one ``nvmlGpmMetricsGet`` a GPU. Both read the same snapshot file, so the replay's
  parsing weighs on both alike; NVML's own time in the calls is not in a replay (scripts/gpu-check times it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import Figure, benchmark, median_seconds
from stagetrace.collectors import available
from stagetrace.collectors.base import REGISTRY, Node, Options, Samples
from stagetrace.collectors.gpu import GpuCollector
from stagetrace.collectors.podresources import RecordedKubelet
from stagetrace.collectors.rdma import RdmaCollector
from stagetrace.nvml import write_nvml_fixture
from stagetrace.exporters.prometheus import exposition

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "node"
KUBELET = FIXTURE.parent / "kubelet" / "h200-node"  # the same 8-GPU node's pods, served by a recorded kubelet
SYSFS = FIXTURE / "sys"
# collector option (and `collect` flag) -> the fixture node's recording, for the whole-node snapshot
FIXTURE_OPTIONS = {
    "nvml_fixture": "nvml",
    "mps_fixture": "mps",
    "nccl_dir": "nccl",
    "ethtool_fixture": "ethtool/statistics.json",
}


def _duration(families, collector: str) -> float:
    """The collector's own timing of itself: stagetrace's or node_exporter's duration gauge."""
    names = ("stagetrace_collector_duration_seconds", "node_scrape_collector_duration_seconds")
    (family,) = [f for f in families if f.name in names]
    return next(s.value for s in family.samples if s.labels["collector"] == collector)


def _rdma_node(sysfs: Path) -> Node:
    return Node([RdmaCollector(Options(sysfs=sysfs, host="bench"))], "bench")


@contextlib.contextmanager
def _node_exporter(binary: str):
    """A node_exporter with only the infiniband collector over the fixture tree; yields its scrape function."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    process = subprocess.Popen(
        [
            binary,
            f"--path.sysfs={SYSFS}",
            "--collector.disable-defaults",
            "--collector.infiniband",
            f"--web.listen-address={url.split('/')[2]}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def scrape() -> float:
        with urllib.request.urlopen(url, timeout=5) as response:
            return _duration(text_string_to_metric_families(response.read().decode()), "infiniband")

    try:
        deadline = time.monotonic() + 15
        while True:  # the first answer is the warm-up scrape
            try:
                scrape()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node_exporter did not answer on {url}") from None
                time.sleep(0.1)
        yield scrape
    finally:
        process.terminate()
        process.wait(timeout=10)


def _rdma_figures(scrapes: int) -> list[Figure]:
    """Ours and node_exporter's collector durations, scrapes interleaved so that load on the machine hits both."""
    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        # node_exporter before 1.6 does not read hw_counters/ (32 files a port here): the same files on both sides
        shutil.copytree(SYSFS, f"{tmp}/sys", ignore=shutil.ignore_patterns("hw_counters"))
        ours, same_files = _rdma_node(SYSFS), _rdma_node(Path(tmp, "sys"))
        theirs = stack.enter_context(_node_exporter(binary)) if binary else None
        runs: dict[str, list[float]] = {"ours": [], "same_files": [], "theirs": []}
        for node in (ours, same_files):
            list(node.collect())  # warm-up
        for _ in range(scrapes):
            runs["ours"].append(_duration(list(ours.collect()), "rdma"))
            runs["same_files"].append(_duration(list(same_files.collect()), "rdma"))
            if theirs:
                runs["theirs"].append(theirs())
    ms = {name: statistics.median(values) * 1e3 if values else None for name, values in runs.items()}
    baseline = (
        f"node_exporter {_node_exporter_version(binary)} infiniband collector"
        if binary
        else "node_exporter (not installed)"
    )
    floor = _cat_floor(scrapes)
    return [
        Figure(f"RDMA collector, 8 mlx5 ports, median of {scrapes} scrapes", ms["ours"], "ms", baseline, ms["theirs"]),
        Figure("RDMA collector, same tree without hw_counters/", ms["same_files"], "ms", baseline, ms["theirs"]),
        Figure(
            f"RDMA collector, 8 mlx5 ports, median of {scrapes} scrapes",
            ms["ours"],
            "ms",
            "coreutils cat(1) opening and reading each of the same files, in one process, less its start-up",
            floor,
        ),
    ]


def _cat_floor(runs: int) -> float:
    """coreutils ``cat`` of every file the RDMA collector reads, in one process, less ``cat`` of nothing: the reads in
    C, each file opened anew (cat opens, fstats, advises, reads, writes and closes each, about seven system calls;
    the collector holds its files open and reads each with one ``pread``). Not the same work: a scale, not a floor."""
    root = SYSFS / "class" / "infiniband"
    files = [str(f) for f in sorted(root.glob("*/ports/*/*counters/*")) if f.is_file()]
    files += [
        str(f) for name in ("rate", "state", "phys_state", "link_layer") for f in sorted(root.glob(f"*/ports/*/{name}"))
    ]
    files += [str(f) for f in sorted(root.glob("*/ports/*/gid_attrs/ndevs/0"))]
    files += [str(f) for name in ("fw_ver", "hca_type") for f in sorted(root.glob(f"*/{name}"))]

    def median_ms(command: list[str]) -> float:
        timings = []
        for _ in range(max(3, runs // 10)):
            started = time.perf_counter()
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            timings.append(time.perf_counter() - started)
        return statistics.median(timings) * 1e3

    return max(0.0, median_ms(["cat", *files]) - median_ms(["cat", "/dev/null"]))


def _node_exporter_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    words = (out.stdout or out.stderr).split()
    return words[2] if len(words) > 2 and words[1] == "version" else "?"


def _whole_node() -> tuple[list[str], Options]:
    """Every collector, with the fixture node's sources."""
    options = Options(sysfs=SYSFS, host="bench")
    for field, recording in FIXTURE_OPTIONS.items():
        setattr(options, field, FIXTURE / recording)
    return list(available()), options


def _flags(options: Options) -> list[str]:
    flags = ["--sysfs", str(options.sysfs), "--kubelet-socket", str(options.kubelet_socket)]
    for field in FIXTURE_OPTIONS:
        flags += [f"--{field.replace('_', '-')}", str(getattr(options, field))]
    return flags


class _SteppedClock:
    """The collector's clock, one scrape interval further at each reading of a scrape: every scrape a GPM interval."""

    def __init__(self, interval_s: float):
        self.now, self.interval_s = 0.0, interval_s

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.interval_s


def _gpm_node_fixture(directory: Path, gpus: int, gpm: bool) -> Path:
    """``gpus`` copies of the recorded H200 (its GPM series included), answering GPM support as ``gpm`` says."""
    snapshot = json.loads((FIXTURE / "nvml" / "h200-gpm" / "nvml.json").read_text())
    recorded = snapshot.pop("gpus")[0]
    copies = []
    for index in range(gpus):
        gpu = json.loads(json.dumps(recorded))
        gpu["nvmlDeviceGetUUID"] = f"{recorded['nvmlDeviceGetUUID'][:-2]}{index:02x}"
        gpu["nvmlGpmQueryDeviceSupport"]["isSupportedDevice"] = int(gpm)
        copies.append(gpu)
    write_nvml_fixture(directory, copies, **snapshot)
    return directory


def _gpu_scrape_ms(directory: Path, scrapes: int) -> float:
    clock = _SteppedClock(1.0)
    collector = GpuCollector(
        Options(nvml_fixture=directory, procfs=FIXTURE / "proc", kubelet_log_dir=FIXTURE / "log", host="bench"),
        clock=clock,
    )

    def scrape() -> None:
        clock.step()
        collector.collect(Samples())

    try:
        return median_seconds(scrape, scrapes, warmup=2) * 1e3
    finally:
        collector.close()


def _gpm_figures(scrapes: int) -> list[Figure]:
    gpus = 8
    with tempfile.TemporaryDirectory() as tmp:
        on = _gpu_scrape_ms(_gpm_node_fixture(Path(tmp, "on"), gpus, gpm=True), scrapes)
        off = _gpu_scrape_ms(_gpm_node_fixture(Path(tmp, "off"), gpus, gpm=False), scrapes)
    return [
        Figure(
            f"gpu collector scrape at 1 s, {gpus} H200s (recorded GPM series), GPM on",
            on,
            "ms",
            "the same GPUs without GPM",
            off,
        ),
        Figure(
            "GPM's cost per GPU per scrape (nvmlGpmSampleGet, nvmlGpmMetricsGet, 12 metrics)",
            (on - off) / gpus * 1e3,
            "µs",
        ),
    ]


@benchmark("collection")
def collection(quick: bool) -> list[Figure]:
    scrapes = 5 if quick else 200
    figures = _rdma_figures(scrapes)
    names, options = _whole_node()
    kubelet = RecordedKubelet(Path(tempfile.mkdtemp(prefix="kubelet-")) / "kubelet.sock", KUBELET).start()
    options.kubelet_socket = kubelet.socket_path
    node = Node([REGISTRY[name](options) for name in names], options.host)
    try:
        in_process = median_seconds(lambda: exposition(node.collect()), 3 if quick else 50) * 1e3
    finally:
        node.close()
    figures.append(Figure(f"whole-node snapshot in-process ({', '.join(names)})", in_process, "ms"))

    command = [
        sys.executable,
        "-m",
        "stagetrace",
        "collect",
        "--once",
        "--collectors",
        ",".join(names),
        *_flags(options),
    ]

    def collect_once():
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip().splitlines()[-1:]}")

    try:
        process = median_seconds(collect_once, 1 if quick else 5, warmup=0 if quick else 1) * 1e3
    finally:
        kubelet.stop()
    figures.append(Figure("`stagetrace collect --once` process, incl. interpreter start-up", process, "ms"))
    figures += _gpm_figures(scrapes)
    return figures
