"""The series the gpu collector reports about who uses each GPU (``gpu_process_*``, ``gpu_tenant_*``,
``gpu_memory_unattributed_bytes``) and the roles a process can have, as data. The collector
(``collectors/gpu_tenants``) writes them; the co-tenant analysis and the GPU dashboard read them, so they live in the
core beside the metric model.
"""

from __future__ import annotations

from stagetrace.metrics import GAUGE, INFO, MetricSpec

GPU_LABELS = ("gpu", "uuid", "model")
TENANT_LABELS = (*GPU_LABELS, "namespace", "pod")  # namespace and pod "" for processes in no pod

PROCESS = MetricSpec(
    "gpu_process_info",
    INFO,
    "A compute process on the GPU, its pod and container (empty outside any pod, or once it exited unseen) and its "
    "role: compute, mps_server or mps_client.",
    (*GPU_LABELS, "pid"),
)
PROCESS_SM = MetricSpec(
    "gpu_process_sm_utilization_ratio",
    GAUGE,
    "SM utilization of the process since the last scrape, NVML's per-process samples (under MPS: the server only).",
    (*GPU_LABELS, "pid"),
    "ratio",
)
PROCESS_MEMORY_COPY = MetricSpec(
    "gpu_process_memory_copy_utilization_ratio",
    GAUGE,
    "Fraction of time the process read or wrote device memory since the last scrape (NVML's per-process samples).",
    (*GPU_LABELS, "pid"),
    "ratio",
)
TENANT_MEMORY = MetricSpec(
    "gpu_tenant_memory_used_bytes",
    GAUGE,
    "Device memory the pod's processes hold on this physical GPU, each process once (MPS clients included).",
    TENANT_LABELS,
    "bytes",
)
TENANT_PROCESSES = MetricSpec(
    "gpu_tenant_processes", GAUGE, "The pod's compute processes on this physical GPU.", TENANT_LABELS
)
TENANT_MPS_CLIENTS = MetricSpec(
    "gpu_tenant_mps_clients",
    GAUGE,
    "The pod's MPS client processes on this GPU: where above 0, NVML cannot say the pod's SM share.",
    TENANT_LABELS,
)
TENANT_SM = MetricSpec(
    "gpu_tenant_sm_utilization_ratio",
    GAUGE,
    "The pod's SM utilization on this GPU since the last scrape: the sum over its processes (none under MPS).",
    TENANT_LABELS,
    "ratio",
)
TENANT_MEMORY_COPY = MetricSpec(
    "gpu_tenant_memory_copy_utilization_ratio",
    GAUGE,
    "Fraction of time the pod's processes read or wrote device memory since the last scrape (none under MPS).",
    TENANT_LABELS,
    "ratio",
)
UNATTRIBUTED = MetricSpec(
    "gpu_memory_unattributed_bytes",
    GAUGE,
    "Used device memory no listed process holds: driver contexts, and processes outside the agent's PID namespace.",
    GPU_LABELS,
    "bytes",
)

# gpu_process_info's roles; the analysis reads MPS_SERVER to know whose utilization is every client's
COMPUTE, MPS_SERVER, MPS_CLIENT = "compute", "mps_server", "mps_client"
UID_POD = "uid:"  # the pod label of a pod the kubelet's log directory does not name: uid:<pod UID>


__all__ = [
    "COMPUTE",
    "GPU_LABELS",
    "MPS_CLIENT",
    "MPS_SERVER",
    "PROCESS",
    "PROCESS_MEMORY_COPY",
    "PROCESS_SM",
    "TENANT_LABELS",
    "TENANT_MEMORY",
    "TENANT_MEMORY_COPY",
    "TENANT_MPS_CLIENTS",
    "TENANT_PROCESSES",
    "TENANT_SM",
    "UID_POD",
    "UNATTRIBUTED",
]
