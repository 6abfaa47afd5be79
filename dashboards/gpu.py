"""GPU & MPS: how busy, hot and throttled each GPU is, its XID and ECC events, MPS co-tenancy, its SM, tensor and DRAM
activity, and who holds and uses it.

Reads the samples the gpu, mps and kubernetes collectors write to ClickHouse (``stagetrace agent``), the
same samples the trace-lookup dashboard and divergence analysis read. The Kubernetes row sets the
scheduler's view (the kubelet's PodResources) beside the hardware's, joined by the physical GPU's UUID:
a card two pods share through MPS replicas shows as one GPU with two allocations and two MPS clients,
and a node whose device plugin advertises two devices for it as counted twice.
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import GPU, HOST, any_selected, counter, gauge
from stagetrace.gpm_metrics import GPM_METRICS
from stagetrace.tenant_metrics import (
    TENANT_MEMORY,
    TENANT_MEMORY_COPY,
    TENANT_MPS_CLIENTS,
    TENANT_PROCESSES,
    TENANT_SM,
    UNATTRIBUTED,
)

UID = "stagetrace-gpu"

HOST_FILTER = any_selected(HOST, "host")
GPU_FILTERS = [HOST_FILTER, any_selected("Attributes['uuid']", "gpu")]
BY_GPU = {"gpu": GPU}


def gpu_gauge(metric: str, value: str, **options) -> str:
    return gauge(metric, BY_GPU, value, where=GPU_FILTERS, **options)


# -- Kubernetes: the kubernetes collector's series, latest scrape of each host, joined with gpu_up and mps_clients

# the newest scrape of each host's kubelet in the range: k8s_gpu_sharing_factor is in every successful one
LATEST_KUBELET_SCRAPE = (
    "(ResourceAttributes['host.name'], TimeUnix) IN (SELECT ResourceAttributes['host.name'], max(TimeUnix) "
    "FROM otel_metrics_gauge WHERE MetricName = 'k8s_gpu_sharing_factor' AND $__timeFilter(TimeUnix) GROUP BY 1)"
)


def _latest_by_gpu(metric: str, value: str, alias: str) -> str:
    """The newest ``value`` of ``metric`` per host and UUID in the range, as ``host, uuid, alias`` (nullable: a GPU
    a LEFT JOIN finds no row for shows NULL, without the join_use_nulls setting a read-only data source refuses)."""
    return (
        f"SELECT {HOST} AS host, Attributes['uuid'] AS uuid, toNullable(argMax({value}, TimeUnix)) AS {alias} "
        f"FROM otel_metrics_gauge WHERE MetricName = '{metric}' AND $__timeFilter(TimeUnix) "
        f"AND {HOST_FILTER} GROUP BY host, uuid"
    )


def who_holds_each_gpu() -> str:
    return f"""
        SELECT a.host AS host, g.gpu AS gpu, a.uuid AS uuid, a.resource AS resource, a.device_id AS device_id,
               a.namespace AS namespace, a.pod AS pod, a.container AS container, n.allocations AS allocations,
               m.clients AS mps_clients, f.factor AS sharing_factor
        FROM (SELECT {HOST} AS host, Attributes['uuid'] AS uuid, Attributes['resource'] AS resource,
                     Attributes['device_id'] AS device_id, Attributes['namespace'] AS namespace,
                     Attributes['pod'] AS pod, Attributes['container'] AS container
              FROM otel_metrics_gauge
              WHERE MetricName = 'k8s_gpu_allocation_info' AND $__timeFilter(TimeUnix) AND {LATEST_KUBELET_SCRAPE}
                AND {" AND ".join(GPU_FILTERS)}) AS a
        LEFT JOIN ({_latest_by_gpu("k8s_gpu_allocations_per_physical", "Value", "allocations")}) AS n
            ON a.host = n.host AND a.uuid = n.uuid
        LEFT JOIN ({_latest_by_gpu("gpu_up", "Attributes['gpu']", "gpu")}) AS g ON a.host = g.host AND a.uuid = g.uuid
        LEFT JOIN ({_latest_by_gpu("mps_clients", "Value", "clients")}) AS m ON a.host = m.host AND a.uuid = m.uuid
        LEFT JOIN (SELECT {HOST} AS host, toNullable(argMax(Value, TimeUnix)) AS factor FROM otel_metrics_gauge
                   WHERE MetricName = 'k8s_gpu_sharing_factor' AND $__timeFilter(TimeUnix) AND {HOST_FILTER}
                   GROUP BY host) AS f ON a.host = f.host
        ORDER BY host, gpu, uuid, device_id, namespace, pod
    """


def scheduler_counts() -> str:
    """Per host and GPU resource, at the newest scrape: what the scheduler counts beside the physical GPUs."""
    verdict = (
        "multiIf(physical = 0, 'no devices advertised', advertised = physical * factor, 'as intended', "
        "advertised > physical * factor AND advertised % physical = 0, "
        "concat('each GPU counted ', if(intDiv(advertised, physical) = 2, 'twice', "
        "concat(toString(intDiv(advertised, physical)), ' times'))), "
        "advertised > physical * factor, 'more devices than GPUs x sharing factor', "
        "'fewer devices than GPUs x sharing factor')"
    )
    return f"""
        SELECT host, resource, advertised, allocated, physical AS physical_gpus, nvml.gpus AS nvml_gpus,
               factor AS sharing_factor,
               if(allocated > advertised AND advertised > 0, 'more allocated than advertised', {verdict}) AS verdict
        FROM (SELECT {HOST} AS host, Attributes['resource'] AS resource,
                     toUInt64(anyIf(Value, MetricName = 'k8s_gpu_allocatable_devices')) AS advertised,
                     toUInt64(anyIf(Value, MetricName = 'k8s_gpu_allocated_devices')) AS allocated,
                     toUInt64(anyIf(Value, MetricName = 'k8s_gpu_physical_devices')) AS physical
              FROM otel_metrics_gauge
              WHERE MetricName IN ('k8s_gpu_allocatable_devices', 'k8s_gpu_allocated_devices', 'k8s_gpu_physical_devices')
                AND $__timeFilter(TimeUnix) AND {LATEST_KUBELET_SCRAPE} AND {HOST_FILTER}
              GROUP BY host, resource) AS d
        INNER JOIN (SELECT {HOST} AS host, toUInt64(argMax(Value, TimeUnix)) AS factor FROM otel_metrics_gauge
                    WHERE MetricName = 'k8s_gpu_sharing_factor' AND $__timeFilter(TimeUnix) AND {HOST_FILTER}
                    GROUP BY host) AS f USING (host)
        LEFT JOIN (SELECT {HOST} AS host, toNullable(uniqExact(Attributes['uuid'])) AS gpus FROM otel_metrics_gauge
                   WHERE MetricName = 'gpu_up' AND $__timeFilter(TimeUnix) AND {HOST_FILTER}
                   GROUP BY host) AS nvml USING (host)
        ORDER BY host, resource
    """


def kubernetes_panels() -> list[dict]:
    node_resource = {"node": f"concat({HOST}, ' ', Attributes['resource'])"}
    return [
        p.row("Kubernetes: who holds each GPU"),
        p.table(
            "Who holds each GPU",
            who_holds_each_gpu(),
            "none",
            height=8,
            sort_by="allocations",
            overrides=[
                p.override(
                    "allocations",
                    custom_cellOptions={"type": "color-background"},
                    thresholds={
                        "mode": "absolute",
                        "steps": [{"color": "transparent", "value": None}, {"color": "orange", "value": 2}],
                    },
                ),
                p.override("mps_clients", noValue="no MPS"),
            ],
            description="Each device the kubelet allocated to a container (PodResources List), at its newest scrape, "
            "and the physical GPU behind it: replica IDs <uuid>::<n> (MPS or time-slicing) resolve to "
            "one UUID. allocations counts the devices allocated on that GPU, mps_clients the MPS "
            "client processes NVML sees on it: a card a TTS service and a worker share shows twice "
            "here, with allocations 2 and mps_clients 2, as one GPU in the panels above.",
        ),
        p.table(
            "What the scheduler counts",
            scheduler_counts(),
            "none",
            height=6,
            overrides=[
                p.override(
                    "verdict",
                    custom_cellOptions={"type": "color-text"},
                    mappings=[
                        {"type": "value", "options": {"as intended": {"color": "green", "index": 0}}},
                        {
                            "type": "regex",
                            "options": {"pattern": "^(each|more|fewer).*", "result": {"color": "red", "index": 1}},
                        },
                    ],
                )
            ],
            description="Per node and GPU resource, at the newest scrape: the devices the device plugin advertises "
            "(the scheduler's capacity), those allocated (its used), the physical GPUs behind them "
            "(and how many NVML sees), and the agent's --gpu-sharing-factor. A node advertising 2 "
            "nvidia.com/gpu devices for 1 physical GPU with the factor 1 is the used: 2, capacity: 1 "
            "state: each GPU counted twice, and the node closed to further pods.",
        ),
        p.timeseries(
            "Allocations per physical GPU",
            gauge(
                "k8s_gpu_allocations_per_physical",
                {"gpu": f"concat({HOST}, ' ', Attributes['uuid'])"},
                "allocations",
                where=GPU_FILTERS,
                function="max",
            ),
            "short",
            description="Devices allocated on each physical GPU, whatever their replica IDs: above "
            "the sharing factor, pods share a card they were each promised.",
        ),
        p.timeseries(
            "Devices advertised, allocated and physical",
            gauge(
                ["k8s_gpu_allocatable_devices", "k8s_gpu_allocated_devices", "k8s_gpu_physical_devices"],
                {**node_resource, "measure": "replaceRegexpOne(MetricName, '^k8s_gpu_(.*)_devices$', '\\\\1')"},
                "devices",
                where=[HOST_FILTER],
                function="max",
            ),
            "short",
            description="The kubelet's allocatable devices (capacity), allocated devices (used) "
            "and the physical GPUs behind them, per node and resource: allocatable "
            "above physical times the sharing factor is the double count.",
        ),
    ]


# -- GPM activity (Hopper and newer) and the tenants of each GPU: the gpu collector's gpm and gpu_tenants series

GPM = {m.spec.name: m.spec for m in GPM_METRICS}
# a MIG GPU instance's series beside its GPU's ("" is the whole GPU)
GPU_OR_INSTANCE = f"concat({GPU}, if(Attributes['gpu_instance'] = '', '', concat(' GI ', Attributes['gpu_instance'])))"


def activity(title: str, metrics: list[str], description: str) -> dict:
    labels = {"gpu": GPU_OR_INSTANCE}
    if len(metrics) > 1:  # which of the metrics, in its own words: tensor_active, tensor_hmma_active
        labels["measure"] = "replaceRegexpOne(MetricName, '^gpu_(.*)_ratio$', '\\\\1')"
    return p.timeseries(
        title,
        gauge([GPM[m].name for m in metrics], labels, "active", where=GPU_FILTERS),
        "percentunit",
        max_value=1,
        width=8,
        description=description,
    )


def tenants_of_each_gpu() -> str:
    """Per GPU, at its newest tenant scrape in the range: each pod's memory, processes, MPS clients, SM and
    memory-copy share (NULL where NVML cannot say: MPS clients), and the memory no listed process holds."""
    tenant = "if(Attributes['pod'] = '', '(no pod)', concat(Attributes['namespace'], '/', Attributes['pod']))"
    shares = {"sm_utilization": TENANT_SM.name, "memory_copy_utilization": TENANT_MEMORY_COPY.name}
    share_columns = ", ".join(
        f"if(countIf(MetricName = '{name}') = 0, NULL, sumIf(Value, MetricName = '{name}')) AS {alias}"
        for alias, name in shares.items()
    )
    names = ", ".join(
        f"'{spec.name}'"
        for spec in (TENANT_MEMORY, TENANT_PROCESSES, TENANT_MPS_CLIENTS, TENANT_SM, TENANT_MEMORY_COPY, UNATTRIBUTED)
    )
    return f"""
        SELECT {HOST} AS host, Attributes['gpu'] AS gpu, Attributes['uuid'] AS uuid,
               if(MetricName = '{UNATTRIBUTED.name}', '(unattributed)', {tenant}) AS tenant,
               sumIf(Value, MetricName IN ('{TENANT_MEMORY.name}', '{UNATTRIBUTED.name}')) AS memory,
               sumIf(Value, MetricName = '{TENANT_PROCESSES.name}') AS processes,
               sumIf(Value, MetricName = '{TENANT_MPS_CLIENTS.name}') AS mps_clients, {share_columns}
        FROM otel_metrics_gauge
        WHERE MetricName IN ({names}) AND $__timeFilter(TimeUnix) AND {" AND ".join(GPU_FILTERS)}
          AND ({HOST}, Attributes['uuid'], TimeUnix) IN (
              SELECT {HOST}, Attributes['uuid'], max(TimeUnix) FROM otel_metrics_gauge
              WHERE MetricName = '{TENANT_PROCESSES.name}' AND $__timeFilter(TimeUnix) GROUP BY 1, 2)
        GROUP BY host, gpu, uuid, tenant
        ORDER BY host, gpu, uuid, tenant = '(unattributed)', memory DESC
    """


def activity_panels() -> list[dict]:
    return [
        p.row("Activity (GPM) and tenants"),
        activity(
            "SM active",
            ["gpu_sm_active_ratio", "gpu_sm_occupancy_ratio"],
            "Fraction of SMs busy and resident warps against the maximum, between two scrapes (NVML GPM, DCGM's "
            "SM active and occupancy). GPUs without GPM (before Hopper) have none: gpu_gpm_supported 0.",
        ),
        activity(
            "Tensor active",
            ["gpu_tensor_active_ratio", "gpu_tensor_hmma_active_ratio"],
            "Fraction of time the SMs ran tensor-core instructions (any, and FP16/BF16 HMMA). A serving GPU "
            "whose memory is full and whose tensor activity stays near zero while a kernel runs is hung.",
        ),
        activity(
            "DRAM bandwidth active",
            ["gpu_dram_bandwidth_active_ratio"],
            "Device memory bandwidth used against its maximum (DCGM's DRAM active): decode is bound by it.",
        ),
        p.table(
            "Tenants of each GPU",
            tenants_of_each_gpu(),
            "none",
            height=8,
            overrides=[
                p.override("memory", unit="bytes"),
                p.override("sm_utilization", unit="percentunit", noValue="MPS: the server's"),
                p.override("memory_copy_utilization", unit="percentunit", noValue="MPS: the server's"),
            ],
            description="Each pod with processes on the physical GPU at its newest scrape, from NVML's process "
            "lists mapped to pods through /proc/<pid>/cgroup: its device memory (each process once, "
            "so the tenants and (unattributed) add up to the GPU's used memory), processes, MPS "
            "clients and SM and memory-copy share. Under MPS NVML samples only the MPS server, so its "
            "clients' pods have no share of their own. `stagetrace explain` names a co-tenant whose "
            "use rose while a request's stage ran on the GPU.",
        ),
    ]


def variables() -> list[dict]:
    gpus_of_hosts = (
        f"SELECT DISTINCT Attributes['uuid'] AS value, {GPU} AS text FROM otel_metrics_gauge "
        f"WHERE MetricName = 'gpu_up' AND $__timeFilter(TimeUnix) AND {HOST_FILTER} ORDER BY text"
    )
    return [
        p.datasource_variable(),
        p.query_variable(
            "host",
            "Host",
            f"SELECT DISTINCT {HOST} AS host FROM otel_metrics_gauge "
            "WHERE MetricName = 'gpu_up' AND $__timeFilter(TimeUnix) ORDER BY host",
        ),
        p.query_variable("gpu", "GPU", gpus_of_hosts, description="GPUs by host and index; the value is the GPU UUID."),
    ]


def panels() -> list[dict]:
    return [
        p.row("Load"),
        p.timeseries(
            "GPU up",
            gpu_gauge("gpu_up", "up", function="min"),
            "bool",
            max_value=1,
            width=8,
            description="0 when NVML no longer answers for the GPU: lost, off the bus or needing a reset.",
        ),
        p.timeseries(
            "Utilization",
            gpu_gauge("gpu_utilization_ratio", "utilization"),
            "percentunit",
            max_value=1,
            width=8,
            description="Share of time a kernel ran on the GPU.",
        ),
        p.timeseries(
            "Memory used",
            gpu_gauge("gpu_memory_used_bytes", "used", function="max"),
            "bytes",
            width=8,
            description="Device memory allocated (reserved memory excluded).",
        ),
        p.timeseries(
            "Power",
            gpu_gauge("gpu_power_watts", "power"),
            "watt",
            width=8,
            description="Power draw, averaged by NVML over one second.",
        ),
        p.timeseries(
            "Temperature",
            gpu_gauge("gpu_temperature_celsius", "temperature", function="max"),
            "celsius",
            width=8,
            description="GPU die temperature.",
        ),
        p.timeseries(
            "SM clock",
            gpu_gauge("gpu_sm_clock_hertz", "sm_clock"),
            "hertz",
            width=8,
            description="Current SM clock: a drop without a drop in load is throttling.",
        ),
        p.timeseries(
            "Throttle reasons active",
            gauge(
                "gpu_clock_event_active",
                {"gpu": GPU, "reason": "Attributes['reason']"},
                "active",
                where=[*GPU_FILTERS, "Attributes['reason'] != 'gpu_idle'"],
                function="max",
            ),
            "bool",
            max_value=1,
            width=12,
            description="NVML clock-event reasons holding the clocks down (idle left out); thermal and "
            "power-brake slowdowns make kernels slower and all-reduce stragglers.",
        ),
        p.timeseries(
            "Memory clock",
            gpu_gauge("gpu_memory_clock_hertz", "memory_clock"),
            "hertz",
            width=12,
            description="Current memory clock.",
        ),
        p.row("Errors"),
        p.timeseries(
            "XID events per interval",
            counter(
                "gpu_xid_errors_total",
                {"gpu": GPU, "xid": "Attributes['xid']"},
                "events",
                where=GPU_FILTERS,
                per_second=False,
                from_series_start=True,
            ),
            "short",
            bars=True,
            description="XID critical errors by code. A GPU's XID series appears at its first event, so "
            "that first event is counted too (48: double-bit ECC, 79: fallen off the bus, "
            "94/95: contained/uncontained ECC).",
        ),
        p.timeseries(
            "ECC errors per interval",
            counter(
                "gpu_ecc_errors_total",
                {"gpu": GPU, "type": "Attributes['type']"},
                "errors",
                where=GPU_FILTERS,
                per_second=False,
            ),
            "short",
            bars=True,
            description="Memory ECC errors (volatile counts). Uncorrected errors corrupt results.",
        ),
        p.timeseries(
            "PCIe throughput",
            gauge(
                ["gpu_pcie_transmit_bytes_per_second", "gpu_pcie_receive_bytes_per_second"],
                {"gpu": GPU, "direction": "if(MetricName LIKE '%transmit%', 'transmit', 'receive')"},
                "throughput",
                where=GPU_FILTERS,
            ),
            "Bps",
            description="PCIe throughput over NVML's 20 ms window.",
        ),
        p.timeseries(
            "NVLink throughput",
            counter(
                ["gpu_nvlink_transmit_bytes_total", "gpu_nvlink_receive_bytes_total"],
                {"gpu": GPU, "direction": "if(MetricName LIKE '%transmit%', 'transmit', 'receive')"},
                "throughput",
                where=GPU_FILTERS,
            ),
            "Bps",
            description="NVLink payload bytes per second, all links of the GPU together.",
        ),
        p.row("MPS"),
        p.timeseries(
            "MPS clients per GPU",
            gpu_gauge("mps_clients", "clients", function="max"),
            "short",
            description="MPS client processes sharing the GPU: co-tenants change timing and batching.",
        ),
        p.timeseries(
            "MPS client memory",
            gauge(
                "mps_client_memory_used_bytes",
                {"gpu": GPU, "pid": "Attributes['pid']"},
                "used",
                where=GPU_FILTERS,
                function="max",
            ),
            "bytes",
            description="Device memory per MPS client process.",
        ),
        p.timeseries(
            "MPS servers and daemon",
            gauge(
                ["mps_servers", "mps_daemon_up"],
                {"host": HOST, "metric": "MetricName"},
                "value",
                where=[HOST_FILTER],
                function="max",
            ),
            "short",
            description="MPS server instances and whether the control daemon answers (1).",
        ),
        p.timeseries(
            "Collector health",
            gauge(
                "stagetrace_collector_success",
                {"host": HOST, "collector": "Attributes['collector']"},
                "success",
                where=[HOST_FILTER, "Attributes['collector'] IN ('gpu', 'mps', 'kubernetes')"],
                function="min",
            ),
            "bool",
            max_value=1,
            description="Whether the gpu, mps and kubernetes collectors' last scrapes succeeded (0: source "
            "unavailable).",
        ),
        *activity_panels(),
        *kubernetes_panels(),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: GPU & MPS",
        "Utilization, memory, power, clocks and throttle reasons, XID and ECC events, MPS clients per GPU, SM, tensor "
        "and DRAM activity (GPM), the tenants of each GPU, and the pods the kubelet allocated each GPU to.",
        panels(),
        variables(),
    )
