"""GPU & MPS: how busy, hot and throttled each GPU is, its XID and ECC events, and MPS co-tenancy.

Reads the samples the gpu and mps collectors write to ClickHouse (``stagetrace agent``), the same
samples the trace-lookup dashboard and divergence analysis read.
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import GPU, HOST, any_selected, counter, gauge

UID = "stagetrace-gpu"

HOST_FILTER = any_selected(HOST, "host")
GPU_FILTERS = [HOST_FILTER, any_selected("Attributes['uuid']", "gpu")]
BY_GPU = {"gpu": GPU}


def gpu_gauge(metric: str, value: str, **options) -> str:
    return gauge(metric, BY_GPU, value, where=GPU_FILTERS, **options)


def variables() -> list[dict]:
    gpus_of_hosts = (
        f"SELECT DISTINCT Attributes['uuid'] AS value, {GPU} AS text FROM otel_metrics_gauge "
        f"WHERE MetricName = 'gpu_up' AND $__timeFilter(TimeUnix) AND {HOST_FILTER} ORDER BY text"
    )
    return [
        p.datasource_variable(),
        p.query_variable("host", "Host",
                         f"SELECT DISTINCT {HOST} AS host FROM otel_metrics_gauge "
                         "WHERE MetricName = 'gpu_up' AND $__timeFilter(TimeUnix) ORDER BY host"),
        p.query_variable("gpu", "GPU", gpus_of_hosts, description="GPUs by host and index; the value is the GPU UUID."),
    ]  # fmt: skip


def panels() -> list[dict]:
    return [
        p.row("Load"),
        p.timeseries("GPU up", gpu_gauge("gpu_up", "up", function="min"), "bool", max_value=1, width=8,
                     description="0 when NVML no longer answers for the GPU: lost, off the bus or needing a reset."),
        p.timeseries("Utilization", gpu_gauge("gpu_utilization_ratio", "utilization"), "percentunit", max_value=1,
                     width=8, description="Share of time a kernel ran on the GPU."),
        p.timeseries("Memory used", gpu_gauge("gpu_memory_used_bytes", "used", function="max"), "bytes", width=8,
                     description="Device memory allocated (reserved memory excluded)."),
        p.timeseries("Power", gpu_gauge("gpu_power_watts", "power"), "watt", width=8,
                     description="Power draw, averaged by NVML over one second."),
        p.timeseries("Temperature", gpu_gauge("gpu_temperature_celsius", "temperature", function="max"), "celsius",
                     width=8, description="GPU die temperature."),
        p.timeseries("SM clock", gpu_gauge("gpu_sm_clock_hertz", "sm_clock"), "hertz", width=8,
                     description="Current SM clock: a drop without a drop in load is throttling."),
        p.timeseries("Throttle reasons active",
                     gauge("gpu_clock_event_active", {"gpu": GPU, "reason": "Attributes['reason']"}, "active",
                           where=[*GPU_FILTERS, "Attributes['reason'] != 'gpu_idle'"], function="max"),
                     "bool", max_value=1, width=12,
                     description="NVML clock-event reasons holding the clocks down (idle left out); thermal and "
                                 "power-brake slowdowns make kernels slower and all-reduce stragglers."),
        p.timeseries("Memory clock", gpu_gauge("gpu_memory_clock_hertz", "memory_clock"), "hertz", width=12,
                     description="Current memory clock."),
        p.row("Errors"),
        p.timeseries("XID events per interval",
                     counter("gpu_xid_errors_total", {"gpu": GPU, "xid": "Attributes['xid']"}, "events",
                             where=GPU_FILTERS, per_second=False, from_series_start=True),
                     "short", bars=True,
                     description="XID critical errors by code. A GPU's XID series appears at its first event, so "
                                 "that first event is counted too (48: double-bit ECC, 79: fallen off the bus, "
                                 "94/95: contained/uncontained ECC)."),
        p.timeseries("ECC errors per interval",
                     counter("gpu_ecc_errors_total", {"gpu": GPU, "type": "Attributes['type']"}, "errors",
                             where=GPU_FILTERS, per_second=False),
                     "short", bars=True,
                     description="Memory ECC errors (volatile counts). Uncorrected errors corrupt results."),
        p.timeseries("PCIe throughput",
                     gauge(["gpu_pcie_transmit_bytes_per_second", "gpu_pcie_receive_bytes_per_second"],
                           {"gpu": GPU, "direction": "if(MetricName LIKE '%transmit%', 'transmit', 'receive')"},
                           "throughput", where=GPU_FILTERS),
                     "Bps", description="PCIe throughput over NVML's 20 ms window."),
        p.timeseries("NVLink throughput",
                     counter(["gpu_nvlink_transmit_bytes_total", "gpu_nvlink_receive_bytes_total"],
                             {"gpu": GPU, "direction": "if(MetricName LIKE '%transmit%', 'transmit', 'receive')"},
                             "throughput", where=GPU_FILTERS),
                     "Bps", description="NVLink payload bytes per second, all links of the GPU together."),
        p.row("MPS"),
        p.timeseries("MPS clients per GPU", gpu_gauge("mps_clients", "clients", function="max"), "short",
                     description="MPS client processes sharing the GPU: co-tenants change timing and batching."),
        p.timeseries("MPS client memory",
                     gauge("mps_client_memory_used_bytes", {"gpu": GPU, "pid": "Attributes['pid']"}, "used",
                           where=GPU_FILTERS, function="max"),
                     "bytes", description="Device memory per MPS client process."),
        p.timeseries("MPS servers and daemon",
                     gauge(["mps_servers", "mps_daemon_up"], {"host": HOST, "metric": "MetricName"}, "value",
                           where=[HOST_FILTER], function="max"),
                     "short", description="MPS server instances and whether the control daemon answers (1)."),
        p.timeseries("Collector health",
                     gauge("stagetrace_collector_success", {"host": HOST, "collector": "Attributes['collector']"},
                           "success", where=[HOST_FILTER, "Attributes['collector'] IN ('gpu', 'mps')"], function="min"),
                     "bool", max_value=1,
                     description="Whether the gpu and mps collectors' last scrapes succeeded (0: source unavailable)."),
    ]  # fmt: skip


def build() -> dict:
    return p.dashboard(
        UID, "stagetrace: GPU & MPS",
        "Utilization, memory, power, clocks and throttle reasons, XID and ECC events, MPS clients per GPU.",
        panels(), variables(),
    )  # fmt: skip
