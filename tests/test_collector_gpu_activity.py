"""GPM activity in the gpu collector: SM, tensor, FP pipes, DRAM, PCIe and NVLink between two scrapes.

No GPU exists here. tests/fixtures/node/nvml/h200-gpm holds a real H200's answers (README beside it): its snapshot
under one matmul process and the GPM series recorded once a second through idle, matmul, device-to-device copies,
idle and two MPS clients, as the ``metrics`` NVML's ``nvmlGpmMetricsGet`` filled between consecutive samples. The
expected values are computed here from those recorded answers with nvml.h's metric IDs and units (percent, MiB/s),
independently of the collector's own table. a100-no-gpm is an Ampere GPU, which has no GPM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.gpu import GpuCollector
from stagetrace.collectors.nvml import FixtureSource, gpu_snapshot, write_nvml_fixture
from tests.samples import scrape, series, value

NVML = Path(__file__).parent / "fixtures" / "node" / "nvml"
H200 = NVML / "h200-gpm"
A100 = NVML / "a100-no-gpm"
MIB = 2**20

# nvml.h, nvmlGpmMetricId_t: the ID, the series, and NVML's unit → the series' unit
PERCENT, MIB_PER_S = (lambda pct: pct / 100), (lambda mib: mib * MIB)
EXPECTED_FROM = {
    2: ("gpu_sm_active_ratio", PERCENT),  # NVML_GPM_METRIC_SM_UTIL
    3: ("gpu_sm_occupancy_ratio", PERCENT),  # NVML_GPM_METRIC_SM_OCCUPANCY
    5: ("gpu_tensor_active_ratio", PERCENT),  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    7: ("gpu_tensor_hmma_active_ratio", PERCENT),  # NVML_GPM_METRIC_HMMA_TENSOR_UTIL
    10: ("gpu_dram_bandwidth_active_ratio", PERCENT),  # NVML_GPM_METRIC_DRAM_BW_UTIL
    11: ("gpu_fp64_active_ratio", PERCENT),  # NVML_GPM_METRIC_FP64_UTIL
    12: ("gpu_fp32_active_ratio", PERCENT),  # NVML_GPM_METRIC_FP32_UTIL
    13: ("gpu_fp16_active_ratio", PERCENT),  # NVML_GPM_METRIC_FP16_UTIL
    20: ("gpu_gpm_pcie_transmit_bytes_per_second", MIB_PER_S),  # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    21: ("gpu_gpm_pcie_receive_bytes_per_second", MIB_PER_S),  # NVML_GPM_METRIC_PCIE_RX_PER_SEC
    60: ("gpu_nvlink_receive_bytes_per_second", MIB_PER_S),  # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
    61: ("gpu_nvlink_transmit_bytes_per_second", MIB_PER_S),  # NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
}
GPM_SERIES = {name for name, _ in EXPECTED_FROM.values()}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def recorded_intervals(directory: Path, gpu: int = 0) -> list[list[dict]]:
    return json.loads((directory / "nvml.json").read_text())["gpus"][gpu]["nvmlGpmMetricsGet"]


def expected(interval: list[dict]) -> dict[str, float]:
    """The series NVML's answers for one interval give: each successful metric in the series' unit."""
    return {
        EXPECTED_FROM[m["metricId"]][0]: EXPECTED_FROM[m["metricId"]][1](m["value"])
        for m in interval
        if m["metricId"] in EXPECTED_FROM and m["nvmlReturn"] == 0
    }


def activity(result, gpu_instance: str = "") -> dict[str, float]:
    return {
        name: value(result, name, gpu=0, gpu_instance=gpu_instance)
        for name in GPM_SERIES
        if series(result, name, gpu=0, gpu_instance=gpu_instance)
    }


def node_of(directory: Path, clock: Clock, **options) -> Node:
    return Node([GpuCollector(Options(nvml_fixture=directory, **options), clock=clock)], host="n1")


def test_gpm_metrics_equal_nvml_formulas_for_every_recorded_interval():
    clock, intervals = Clock(), recorded_intervals(H200)
    node = node_of(H200, clock)
    first = scrape(node)
    assert value(first, "gpu_gpm_supported", gpu=0) == 1
    assert activity(first) == {}  # one sample: nothing to compute between yet

    for interval in intervals:
        clock.now += 1.0
        result = scrape(node)
        assert activity(result) == pytest.approx(expected(interval), rel=1e-12, abs=0)
        assert value(result, "stagetrace_collector_success", collector="gpu") == 1


def test_the_gpm_table_ids_are_pynvmls_constants():
    # the table writes nvml.h's IDs out so that readers of it need not load pynvml; they must stay pynvml's
    import pynvml
    from stagetrace.collectors import gpm

    written = {name: getattr(gpm, name) for name in dir(gpm) if name.startswith("NVML_GPM_METRIC_")}
    assert len(written) == len(gpm.GPM_METRICS)
    assert written == {name: getattr(pynvml, name) for name in written}
    assert {m.metric_id: m.spec.name for m in gpm.GPM_METRICS} == {i: name for i, (name, _) in EXPECTED_FROM.items()}


def test_activity_tells_apart_what_utilization_does_not():
    """The recording's matmul and its copies both read 100% utilization; GPM says tensor cores against DRAM."""
    clock = Clock()
    node = node_of(H200, clock)
    scrape(node)
    seen = []
    for _ in recorded_intervals(H200):
        clock.now += 1.0
        seen.append(activity(scrape(node)))
    matmul, copies = seen[20], seen[55]  # the recording's 21st second (matmul) and 56th (copies)
    assert matmul["gpu_tensor_hmma_active_ratio"] > 0.9 and matmul["gpu_dram_bandwidth_active_ratio"] < 0.2
    assert copies["gpu_tensor_active_ratio"] == 0 and copies["gpu_dram_bandwidth_active_ratio"] > 0.88
    assert matmul["gpu_sm_occupancy_ratio"] < 0.15 < 0.8 < copies["gpu_sm_occupancy_ratio"]


def test_a_metric_the_gpu_does_not_answer_is_counted_once_and_not_asked_again():
    """The recording did not ask FP64, which the snapshot therefore answers NotSupported."""
    clock = Clock()
    node = node_of(H200, clock)
    for _ in range(5):
        result = scrape(node)
        clock.now += 1.0
    assert series(result, "gpu_fp64_active_ratio") == []
    assert (
        value(result, "gpu_nvml_errors_total", gpu=0, function="nvmlGpmMetricsGet", error="NVMLError_NotSupported") == 1
    )
    assert len(activity(result)) == len(GPM_SERIES) - 1


def test_a_scrape_sooner_than_100ms_keeps_the_older_sample():
    clock, intervals = Clock(), recorded_intervals(H200)
    node = node_of(H200, clock)
    scrape(node)
    clock.now += 0.05
    assert activity(scrape(node)) == {}  # too soon for NVML: no new sample taken
    clock.now += 1.0
    assert activity(scrape(node)) == pytest.approx(expected(intervals[0]))  # the first interval, not the second


def test_the_replay_goes_round_the_recording_again():
    clock, intervals = Clock(), recorded_intervals(H200)
    node = node_of(H200, clock)
    scrape(node)
    for _ in range(len(intervals) + 1):
        clock.now += 1.0
        result = scrape(node)
    assert activity(result) == pytest.approx(expected(intervals[0]))


class CountingSource(FixtureSource):
    def __init__(self, directory):
        super().__init__(directory)
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def read(self, gpu, function, *constants):
        self._count(function)
        return super().read(gpu, function, *constants)

    def gpm_sample(self, gpu, instance=None):
        self._count("nvmlGpmSampleGet")
        return super().gpm_sample(gpu, instance)


def test_a_gpu_without_gpm_reports_gpm_supported_0_and_nothing_else_gpm():
    clock, source = Clock(), CountingSource(A100)
    node = Node([GpuCollector(Options(), source=source, clock=clock)], host="n1")
    for _ in range(3):
        result = scrape(node)
        clock.now += 1.0
    assert value(result, "gpu_gpm_supported", gpu=0, model="NVIDIA A100-SXM4-80GB") == 0
    assert not [
        name
        for name, found in result.items()
        if found and (name in GPM_SERIES or any("gpu_instance" in labels for labels, _ in found))
    ]
    assert not series(result, "gpu_nvml_errors_total", function="nvmlGpmMetricsGet")
    assert source.calls["nvmlGpmQueryDeviceSupport"] == 1  # asked once
    assert "nvmlGpmSampleGet" not in source.calls
    assert value(result, "gpu_utilization_ratio", gpu=0) == 0.87  # the rest as before


def test_an_older_driver_without_the_gpm_call_reads_as_no_gpm(tmp_path):
    snapshot = gpu_snapshot("GPU-older")
    snapshot["nvmlGpmQueryDeviceSupport"] = "NVMLError_FunctionNotFound"
    write_nvml_fixture(tmp_path, [snapshot])
    clock = Clock()
    node = node_of(tmp_path, clock)
    for _ in range(3):
        result = scrape(node)
        clock.now += 1.0
    assert value(result, "gpu_gpm_supported", gpu=0) == 0
    assert (
        value(
            result,
            "gpu_nvml_errors_total",
            gpu=0,
            function="nvmlGpmQueryDeviceSupport",
            error="NVMLError_FunctionNotFound",
        )
        == 1
    )


def test_mig_instances_get_their_own_activity(tmp_path):
    """A MIG-enabled GPU: the whole GPU's activity, and each GPU instance's from nvmlGpmMigSampleGet."""
    intervals = recorded_intervals(H200)
    snapshot = gpu_snapshot("GPU-mig")
    snapshot.update(
        nvmlDeviceGetMigMode=[1, 1],
        nvmlGpmQueryDeviceSupport={"version": 1, "isSupportedDevice": 1},
        nvmlGpmMetricsGet=intervals[10:12],
        nvmlGpmMigSampleGet={"1": intervals[20:22], "2": intervals[50:52]},
    )
    write_nvml_fixture(tmp_path, [snapshot])
    clock = Clock()
    node = node_of(tmp_path, clock)
    scrape(node)
    clock.now += 1.0
    result = scrape(node)
    assert activity(result, "") == pytest.approx(expected(intervals[10]))
    assert activity(result, "1") == pytest.approx(expected(intervals[20]))
    assert activity(result, "2") == pytest.approx(expected(intervals[50]))


def test_mig_disabled_asks_no_instance():
    clock, source = Clock(), CountingSource(H200)
    node = Node([GpuCollector(Options(), source=source, clock=clock)], host="n1")
    scrape(node)
    clock.now += 1
    result = scrape(node)
    assert {labels["gpu_instance"] for labels, _ in result["gpu_sm_active_ratio"]} == {""}
    assert "nvmlGpmMigSampleGet" not in source.calls


@pytest.fixture
def h200_copy(tmp_path) -> Path:
    shutil.copy(H200 / "nvml.json", tmp_path / "nvml.json")
    return tmp_path


def edit(directory: Path, change) -> None:
    snapshot = json.loads((directory / "nvml.json").read_text())
    change(snapshot["gpus"][0])
    gpus = snapshot.pop("gpus")
    write_nvml_fixture(directory, gpus, **snapshot)


def test_gpm_errors_are_counted_per_call_and_never_fail_the_scrape(h200_copy):
    clock, intervals = Clock(), recorded_intervals(H200)
    node = node_of(h200_copy, clock)
    scrape(node)

    edit(h200_copy, lambda gpu: gpu.update(nvmlGpmSampleGet="NVMLError_Timeout"))
    clock.now += 1.0
    result = scrape(node)
    assert value(result, "stagetrace_collector_success", collector="gpu") == 1
    assert value(result, "gpu_up", gpu=0) == 1 and value(result, "gpu_power_watts", gpu=0) > 0
    assert activity(result) == {} and value(result, "gpu_gpm_supported", gpu=0) == 1
    assert value(result, "gpu_nvml_errors_total", gpu=0, function="nvmlGpmSampleGet", error="NVMLError_Timeout") == 1

    edit(h200_copy, lambda gpu: (gpu.pop("nvmlGpmSampleGet"), gpu.update(nvmlGpmMetricsGet="NVMLError_Timeout")))
    clock.now += 1.0
    scrape(node)  # a fresh first sample: the failed one left none
    clock.now += 1.0
    result = scrape(node)
    assert activity(result) == {} and value(result, "gpu_up", gpu=0) == 1
    assert value(result, "gpu_nvml_errors_total", gpu=0, function="nvmlGpmMetricsGet", error="NVMLError_Timeout") == 1

    edit(h200_copy, lambda gpu: gpu.update(nvmlGpmMetricsGet=intervals))
    clock.now += 1.0
    result = scrape(node)  # a timeout is passing: asked again, and answered
    assert (
        activity(result)
        and value(result, "gpu_nvml_errors_total", gpu=0, function="nvmlGpmSampleGet", error="NVMLError_Timeout") == 1
    )


def test_a_gpu_lost_while_sampling_is_gpu_up_0(h200_copy):
    clock = Clock()
    node = node_of(h200_copy, clock)
    scrape(node)
    edit(h200_copy, lambda gpu: gpu.update(nvmlGpmSampleGet="NVMLError_GpuIsLost"))
    clock.now += 1.0
    result = scrape(node)
    assert value(result, "gpu_up", gpu=0) == 0 and value(result, "stagetrace_collector_success", collector="gpu") == 1
    assert activity(result) == {}


def test_record_writes_a_gpm_interval_that_replays_as_what_nvml_answered(tmp_path):
    from stagetrace.collectors.gpu import record_nvml_fixture

    intervals = recorded_intervals(H200)
    record_nvml_fixture(FixtureSource(H200), tmp_path, gpm_interval_s=0)
    recording = recorded_intervals(tmp_path)
    assert len(recording) == 1 and expected(recording[0]) == expected(intervals[0])
    assert {m["metricId"]: m["nvmlReturn"] for m in recording[0]}[11] == 3  # FP64: NVML_ERROR_NOT_SUPPORTED

    clock = Clock()
    node = node_of(tmp_path, clock)
    scrape(node)
    clock.now += 1.0
    assert activity(scrape(node)) == pytest.approx(expected(intervals[0]))


def test_a_destroyed_mig_instance_stops_reporting_and_frees_its_sample(tmp_path):
    intervals = recorded_intervals(H200)
    snapshot = gpu_snapshot("GPU-mig")
    snapshot.update(
        nvmlDeviceGetMigMode=[1, 1],
        nvmlGpmQueryDeviceSupport={"version": 1, "isSupportedDevice": 1},
        nvmlGpmMetricsGet=intervals,
        nvmlGpmMigSampleGet={"1": intervals, "2": intervals},
    )
    write_nvml_fixture(tmp_path, [snapshot])
    freed = []

    class Source(FixtureSource):
        def gpm_free(self, sample):
            freed.append(sample)

    clock = Clock()
    node = Node([GpuCollector(Options(), source=Source(tmp_path), clock=clock)], host="n1")
    scrape(node)
    snapshot["nvmlGpmMigSampleGet"].pop("2")
    write_nvml_fixture(tmp_path, [snapshot])
    clock.now += 1.0
    result = scrape(node)
    assert {labels["gpu_instance"] for labels, _ in result["gpu_sm_active_ratio"]} == {"", "1"}
    assert len(freed) == 3  # the two intervals' older samples, and instance 2's last one
