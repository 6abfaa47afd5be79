"""The nccl collector over NCCL Inspector Prometheus dumps.

No NCCL job can run here, so ``tests/fixtures/node/nccl`` holds dumps for the fixture node's 8 GPUs
written in the exact format of NVIDIA/nccl ``plugins/profiler/inspector/inspector_prom.cc`` (file
name, label order, ``%.6g`` values, bucket order; composed, not recorded from a job). GPU3 is slow:
its all-reduces cross the NIC behind mlx5_3, the one with pause storms in the RDMA and ethtool fixtures.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from stagetrace.collectors.base import REGISTRY, Node, Options, SourceUnavailable
from stagetrace.collectors.nccl import NcclCollector

FIXTURE = Path(__file__).parent / "fixtures" / "node" / "nccl"
SLOW_GPU = "GPU-1b9f6c2d-e8a4-4735-a0d1-5c7e9f2b3a68"  # index 3 in the NVML fixture
LINE = re.compile(r"^(?P<name>\w+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
# Inspector name -> (stagetrace name, factor) as the issue asks: base units
RENAMED = {
    "nccl_collective_exec_time_microseconds": ("nccl_collective_time_seconds", 1e-6),
    "nccl_bus_bandwidth_gbs": ("nccl_collective_bus_bandwidth_bytes_per_second", 1e9),
    "nccl_collectives_total": ("nccl_collectives_total", 1),
    "nccl_collectives_dropped_total": ("nccl_collectives_dropped_total", 1),
    "nccl_p2p_total": ("nccl_p2p_operations_total", 1),
    "nccl_p2p_dropped_total": ("nccl_p2p_operations_dropped_total", 1),
}


def scrape(collector_or_node) -> dict[tuple[str, frozenset], float]:
    node = collector_or_node if isinstance(collector_or_node, Node) else Node([collector_or_node], "node1")
    return {(s.name, frozenset(s.labels.items())): s.value for family in node.collect() for s in family.samples}


def series(scraped, name, **labels) -> dict[frozenset, float]:
    """The samples of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return {lbl: v for (n, lbl), v in scraped.items() if n == name and wanted <= lbl}


@pytest.fixture
def dumps(tmp_path) -> Path:
    """The fixture dumps, freshly written (copying gives them a current mtime, as a running job would)."""
    directory = tmp_path / "nccl-inspector"
    directory.mkdir()
    for dump in FIXTURE.iterdir():
        shutil.copyfile(dump, directory / dump.name)
    return directory


def collector_for(directory) -> NcclCollector:
    return NcclCollector(Options(host="node1", nccl_dir=directory))


def test_registered_and_opt_in():
    assert REGISTRY["nccl"] is NcclCollector
    assert NcclCollector.default_enabled is False


def test_every_dump_sample_is_re_exported_in_base_units(dumps):
    scraped = scrape(collector_for(dumps))
    checked = 0
    for dump in sorted(dumps.iterdir()):
        uuid = "GPU-" + dump.name.removeprefix("nccl_inspector_metrics_").removesuffix(".prom")
        for line in dump.read_text().splitlines():
            m = LINE.match(line)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            name, factor = RENAMED[m["name"]]
            expected_labels = {k: v for k, v in labels.items() if k not in ("version", "gpu")}
            expected_labels |= {"host": "node1", "uuid": uuid, "cuda_device": labels["gpu"].removeprefix("GPU")}
            assert scraped[(name, frozenset(expected_labels.items()))] == pytest.approx(float(m["value"]) * factor)
            checked += 1
    assert checked == 8 * 10  # 8 GPUs x (3 buckets x 2 metrics + 4 device counters)
    assert scraped[("stagetrace_collector_success", frozenset({("collector", "nccl"), ("host", "node1")}))] == 1


def test_uuid_joins_the_gpu_collector_series(dumps):
    """The dumps are named after the NVML fixture's GPUs, with the UUID as NVML writes it."""
    nvml = json.loads((FIXTURE.parent / "nvml" / "nvml.json").read_text())
    by_index = {
        dict(lbl)["cuda_device"]: dict(lbl)["uuid"]
        for lbl in series(scrape(collector_for(dumps)), "nccl_collectives_total")
    }
    assert by_index == {str(i): gpu["nvmlDeviceGetUUID"] for i, gpu in enumerate(nvml["gpus"])}


def test_the_slow_gpu_stands_out(dumps):
    scraped = scrape(collector_for(dumps))
    large = {"collective": "AllReduce", "message_size": "32-33MB"}
    times = {dict(lbl)["uuid"]: v for lbl, v in series(scraped, "nccl_collective_time_seconds", **large).items()}
    bandwidth = {
        dict(lbl)["uuid"]: v
        for lbl, v in series(scraped, "nccl_collective_bus_bandwidth_bytes_per_second", **large).items()
    }
    assert len(times) == len(bandwidth) == 8
    assert max(times, key=times.get) == SLOW_GPU == min(bandwidth, key=bandwidth.get)
    others = sorted(v for uuid, v in times.items() if uuid != SLOW_GPU)
    assert times[SLOW_GPU] > 2 * others[len(others) // 2] and 1e-3 < times[SLOW_GPU] < 1e-2  # ~4 ms, in seconds
    assert 1e10 < bandwidth[SLOW_GPU] < 2e10  # ~15 GB/s, in bytes per second
    [(labels, _)] = series(scraped, "nccl_collective_time_seconds", uuid=SLOW_GPU, **large).items()
    assert (
        dict(labels)["cuda_device"] == "3" and dict(labels)["nranks"] == "16" and dict(labels)["node"] == "gpu-node-1"
    )


def test_stale_dump_is_left_out_but_its_age_shown(dumps):
    stale = next(dumps.glob(f"*{SLOW_GPU.removeprefix('GPU-')}.prom"))
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    scraped = scrape(collector_for(dumps))
    assert not series(scraped, "nccl_collective_time_seconds", uuid=SLOW_GPU)
    assert len({dict(lbl)["uuid"] for lbl in series(scraped, "nccl_collective_time_seconds")}) == 7
    ages = {dict(lbl)["uuid"]: v for lbl, v in series(scraped, "nccl_inspector_dump_age_seconds").items()}
    assert len(ages) == 8 and ages[SLOW_GPU] == pytest.approx(3600, abs=60)
    assert all(age < 60 for uuid, age in ages.items() if uuid != SLOW_GPU)

    collector = collector_for(dumps)
    collector.stale_after = None  # a site whose dump interval is longer than the default window
    assert series(scrape(collector), "nccl_collective_time_seconds", uuid=SLOW_GPU)


def test_malformed_dump_is_skipped_once_logged_and_others_read(dumps, caplog):
    (dumps / "nccl_inspector_metrics_00000000-0000-0000-0000-0000000000ff.prom").write_bytes(b"\x00\x17garbage {{{\n")
    collector = collector_for(dumps)
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        first, second = scrape(collector), scrape(collector)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "0000000000ff.prom" in warnings[0] and "\n" not in warnings[0]
    for scraped in (first, second):
        assert len({dict(lbl)["uuid"] for lbl in series(scraped, "nccl_collective_time_seconds")}) == 8
        assert not series(scraped, "nccl_inspector_dump_age_seconds", uuid="GPU-00000000-0000-0000-0000-0000000000ff")
        assert scraped[("stagetrace_collector_success", frozenset({("collector", "nccl"), ("host", "node1")}))] == 1


def test_empty_and_half_written_dumps(tmp_path, caplog):
    """The plugin truncates a dump and appends line by line: a reader can see nothing, or a line cut short."""
    (tmp_path / "nccl_inspector_metrics_aaaaaaaa-0000-0000-0000-000000000001.prom").write_text("")
    source = (FIXTURE / f"nccl_inspector_metrics_{SLOW_GPU.removeprefix('GPU-')}.prom").read_text()
    cut = source.index("\n", source.index("\n") + 1) + 40  # two whole lines, then part of the third
    (tmp_path / "nccl_inspector_metrics_aaaaaaaa-0000-0000-0000-000000000002.prom").write_text(source[:cut])
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        scraped = scrape(collector_for(tmp_path))
    assert not caplog.records
    assert len(series(scraped, "nccl_inspector_dump_age_seconds")) == 2
    assert len(series(scraped, "nccl_collective_time_seconds")) == 1
    assert len(series(scraped, "nccl_collective_bus_bandwidth_bytes_per_second")) == 1


def test_repeated_series_keeps_the_later_value_and_unknown_metrics_are_ignored(tmp_path):
    labels = 'gpu="GPU0",node="n",collective="AllReduce",message_size="1-2MB",algo_proto="Ring_LL"'
    (tmp_path / "nccl_inspector_metrics_aaaaaaaa-0000-0000-0000-000000000003.prom").write_text(
        f"nccl_collective_exec_time_microseconds{{{labels}}} 10\n"
        f"nccl_collective_exec_time_microseconds{{{labels}}} 20\n"
        f'nccl_some_future_metric{{gpu="GPU0"}} 1\n'
    )
    (tmp_path / "README").write_text("not a dump\n")
    scraped = scrape(collector_for(tmp_path))
    [value] = series(scraped, "nccl_collective_time_seconds").values()
    assert value == pytest.approx(20e-6)
    assert {name for name, _ in scraped} == {
        "nccl_collective_time_seconds",
        "nccl_inspector_dump_age_seconds",
        "stagetrace_collector_success",
        "stagetrace_collector_duration_seconds",
    }


def test_empty_directory_is_a_success_with_no_series(tmp_path):
    scraped = scrape(collector_for(tmp_path))
    assert {name for name, _ in scraped} == {"stagetrace_collector_success", "stagetrace_collector_duration_seconds"}
    assert scraped[("stagetrace_collector_success", frozenset({("collector", "nccl"), ("host", "node1")}))] == 1


@pytest.mark.parametrize("configured", [None, "missing"])
def test_no_directory_is_source_unavailable(tmp_path, configured, caplog):
    directory = None if configured is None else tmp_path / configured
    collector = collector_for(directory)
    with pytest.raises(SourceUnavailable) as raised:
        collector.collect(None)
    assert "\n" not in str(raised.value)
    assert ("STAGETRACE_NCCL_DIR" if configured is None else str(directory)) in str(raised.value)
    node = Node([collector], "node1")
    with caplog.at_level(logging.WARNING, logger="stagetrace.collectors"):
        scraped, _ = scrape(node), scrape(node)
    assert scraped[("stagetrace_collector_success", frozenset({("collector", "nccl"), ("host", "node1")}))] == 0
    assert len(caplog.records) == 1  # the node logs an absent source once, not every scrape
