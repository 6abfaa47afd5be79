"""Who uses each GPU: its compute processes, their pods, and each pod's memory and SM share (the gpu collector's).

NVML lists a GPU's processes with their memory (``nvmlDeviceGetComputeRunningProcesses``; under MPS the server and
every client, and ``nvmlDeviceGetMPSComputeRunningProcesses`` the clients alone) and the SM and memory utilization of
the processes that used the GPU since the last call (``nvmlDeviceGetProcessUtilization``). A process's pod is read
from the host: ``<procfs>/<pid>/cgroup`` names the pod's UID and the container's ID in the kubelet's cgroup layout
(``kubepods[-<qos>]-pod<uid>.slice/cri-containerd-<id>.scope`` with the systemd driver,
``kubepods/<qos>/pod<uid>/<id>`` with cgroupfs, cgroup v1 or v2), and the kubelet's log directory names them:
``<log dir>/containers/<pod>_<namespace>_<container>-<id>.log`` for each container, ``<log dir>/pods/
<namespace>_<pod>_<uid>/`` for each pod (kubelet ``kuberuntime``: ``BuildPodLogsDirectory``, the legacy container log
symlinks). The PodResources API the kubernetes collector reads names pods and containers but no UIDs, so the join
with its allocations is by labels: ``k8s_gpu_allocation_info{uuid, namespace, pod}`` beside
``gpu_tenant_memory_used_bytes{uuid, namespace, pod}``.

Memory is counted once per process (a PID in both lists once), so a GPU's tenants and
``gpu_memory_unattributed_bytes`` (driver contexts, processes NVML does not show) add up to its used memory. Under MPS
NVML samples only the MPS server's utilization (its clients' work runs in the server), so a pod with MPS clients gets
no SM share: ``gpu_tenant_mps_clients`` says so, rather than a 0 that reads as idle.

The agent sees other containers' processes only in the host's PID namespace (``hostPID: true``, or the host's /proc
at ``--procfs``): NVML answers with the PIDs of the caller's namespace. Without it the per-process lists are empty
and a GPU's used memory is all unattributed.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from stagetrace.collectors.base import Setting
from stagetrace.environment_variables import STAGETRACE_KUBELET_LOG_DIR, STAGETRACE_PROCFS
from stagetrace.metrics import MetricSpec

# the series and the roles are data the analysis and the dashboards read too: they live in the core
from stagetrace.tenant_metrics import (  # noqa: F401  (importable from here, as before)
    COMPUTE,
    GPU_LABELS,
    MPS_CLIENT,
    MPS_SERVER,
    PROCESS,
    PROCESS_MEMORY_COPY,
    PROCESS_SM,
    TENANT_LABELS,
    TENANT_MEMORY,
    TENANT_MEMORY_COPY,
    TENANT_MPS_CLIENTS,
    TENANT_PROCESSES,
    TENANT_SM,
    UID_POD,
    UNATTRIBUTED,
)

logger = logging.getLogger("stagetrace.collectors.gpu")

PROCFS = Setting(
    "procfs",
    Path,
    "/proc",
    env=STAGETRACE_PROCFS,
    flag="--procfs",
    metavar="DIR",
    help="procfs root whose <pid>/cgroup names each GPU process's pod (the host's, e.g. /host/proc)",
)
KUBELET_LOG_DIR = Setting(
    "kubelet_log_dir",
    Path,
    "/var/log",
    env=STAGETRACE_KUBELET_LOG_DIR,
    flag="--kubelet-log-dir",
    metavar="DIR",
    help="the host's /var/log, whose pods/ and containers/ name the kubelet's pod UIDs and container IDs",
)

MPS_SERVER_COMM = "nvidia-cuda-mps-server"

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_UID = re.compile(rf"pod({_UID})")  # systemd's driver writes the UID's dashes as underscores
_CONTAINER_ID = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?$")
_CONTAINER_LOG = re.compile(r"^([^_]+)_([^_]+)_(.+)-([0-9a-f]{64})\.log$")


@dataclass(frozen=True)
class Owner:
    """Where a process runs: its pod and container, all empty for a process in no pod. A pod the kubelet's log
    directory does not name (not mounted, or not written yet) is ``uid:<pod UID>``, so two such pods stay apart."""

    namespace: str = ""
    pod: str = ""
    container: str = ""


NO_POD = Owner()


def cgroup_ids(text: str) -> tuple[str, str] | None:
    """``(pod UID, container ID)`` of a ``/proc/<pid>/cgroup`` in the kubelet's layout (container ID "" where the
    path does not end in one); None for a process in no pod."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        found = _POD_UID.search(path)
        if found:
            container = _CONTAINER_ID.search(path)
            return found.group(1).replace("_", "-"), container.group(1) if container else ""
    return None


class PodNames:
    """The kubelet's names for pod UIDs and container IDs, from its log directory (listed at most once a scrape)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self._containers: dict[str, Owner] | None = None
        self._pods: dict[str, Owner] | None = None

    def refresh(self) -> None:
        """Forget the listings: the next lookup lists the directories again."""
        self._containers = self._pods = None

    def container(self, container_id: str) -> Owner | None:
        if self._containers is None:
            self._containers = {}
            for name in _listdir(self.log_dir / "containers"):
                match = _CONTAINER_LOG.match(name)
                if match:
                    pod, namespace, container, cid = match.groups()
                    self._containers[cid] = Owner(namespace, pod, container)
        return self._containers.get(container_id)

    def pod(self, uid: str) -> Owner | None:
        if self._pods is None:
            self._pods = {}
            for name in _listdir(self.log_dir / "pods"):
                parts = name.split("_")  # namespaces and pod names cannot hold "_"
                if len(parts) == 3:
                    self._pods[parts[2]] = Owner(parts[0], parts[1])
        return self._pods.get(uid)


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # not mounted: a process in a pod reads as uid:<pod UID>, one in no pod as no pod
        return []


class ProcessOwners:
    """PID → :class:`Owner`, read from ``<procfs>/<pid>/cgroup`` at each scrape; the last owner found is kept while
    NVML lists the PID, so a process that exits between NVML's answer and the read keeps its pod."""

    def __init__(self, procfs: Path, names: PodNames):
        self.procfs = Path(procfs)
        self.names = names
        self._known: dict[int, Owner] = {}
        self._roles: dict[int, str] = {}
        self._listed: set[int] = set()

    def begin(self) -> None:
        self.names.refresh()
        self._listed = set()

    def owner(self, pid: int) -> Owner | None:
        """The process's owner; None when it is gone (or unreadable) and was never seen before."""
        if pid in self._listed:  # read already this scrape: a process on several GPUs
            return self._known.get(pid)
        self._listed.add(pid)
        try:
            text = (self.procfs / str(pid) / "cgroup").read_text()
        except OSError:
            return self._known.get(pid)
        ids = cgroup_ids(text)
        owner = NO_POD if ids is None else self._name(*ids)
        self._known[pid] = owner
        return owner

    def _name(self, uid: str, container_id: str) -> Owner:
        by_container = self.names.container(container_id) if container_id else None
        if by_container is not None:
            return by_container
        pod = self.names.pod(uid)
        return pod if pod is not None else Owner(pod=f"{UID_POD}{uid}")  # a pod the log directory does not name (yet)

    def is_mps_server(self, pid: int) -> bool:
        if pid not in self._roles:
            try:
                comm = (self.procfs / str(pid) / "comm").read_text().strip()
            except OSError:
                return False
            self._roles[pid] = comm
        return self._roles[pid] == MPS_SERVER_COMM

    def end(self) -> None:
        """Forget the processes no GPU listed this scrape: their PIDs may be reused."""
        for table in (self._known, self._roles):
            for pid in set(table) - self._listed:
                del table[pid]


@dataclass
class _Tenant:
    memory: int = 0
    processes: int = 0
    mps_clients: int = 0
    sm: float = 0.0
    memory_copy: float = 0.0
    sampled: bool = False


Pending = list[tuple[MetricSpec, Any, dict[str, Any]]]


def tenant_samples(
    running: Iterable[Mapping] | None,
    mps_clients: Iterable[Mapping] | None,
    utilization: Iterable[Mapping] | None,
    used_memory: int | None,
    owners: ProcessOwners,
) -> Pending:
    """One GPU's process and tenant series from NVML's answers (None: NVML did not answer that call).

    ``running`` and ``mps_clients`` are the process lists, ``utilization`` the process samples since the last call;
    each process is counted once, by PID, its memory from the first list that gives it.
    """
    if running is None and mps_clients is None:
        return []
    memory: dict[int, int | None] = {}
    clients = {p["pid"] for p in mps_clients or ()}
    for process in (*(running or ()), *(mps_clients or ())):
        if memory.get(process["pid"]) is None:
            memory[process["pid"]] = process["usedGpuMemory"]
    samples: dict[int, list[Mapping]] = defaultdict(list)
    for sample in utilization or ():
        samples[sample["pid"]].append(sample)

    pending: Pending = []
    tenants: dict[Owner, _Tenant] = defaultdict(_Tenant)
    for pid in sorted(memory):
        owner = owners.owner(pid) or NO_POD
        role = MPS_CLIENT if pid in clients else MPS_SERVER if owners.is_mps_server(pid) else COMPUTE
        pending.append(
            (
                PROCESS,
                {"namespace": owner.namespace, "pod": owner.pod, "container": owner.container, "role": role},
                {"pid": pid},
            )
        )
        tenant = tenants[Owner(owner.namespace, owner.pod)]
        tenant.processes += 1
        tenant.mps_clients += role == MPS_CLIENT
        tenant.memory += memory[pid] or 0
        if samples.get(pid):
            sm = fmean(s["smUtil"] for s in samples[pid]) / 100
            copy = fmean(s["memUtil"] for s in samples[pid]) / 100
            pending += [(PROCESS_SM, sm, {"pid": pid}), (PROCESS_MEMORY_COPY, copy, {"pid": pid})]
            tenant.sm += sm
            tenant.memory_copy += copy
    for pid in sorted(samples.keys() - memory.keys()):  # exited between the two calls: its work was its pod's
        owner = owners.owner(pid)
        if owner is not None:
            tenant = tenants[Owner(owner.namespace, owner.pod)]
            tenant.sm += fmean(s["smUtil"] for s in samples[pid]) / 100
            tenant.memory_copy += fmean(s["memUtil"] for s in samples[pid]) / 100
    for owner in sorted(tenants, key=lambda o: (o.namespace, o.pod)):
        tenant, labels = tenants[owner], {"namespace": owner.namespace, "pod": owner.pod}
        pending += [
            (TENANT_MEMORY, tenant.memory, labels),
            (TENANT_PROCESSES, tenant.processes, labels),
            (TENANT_MPS_CLIENTS, tenant.mps_clients, labels),
        ]
        # NVML samples only processes that used the GPU: no sample is 0, except for MPS clients, whose work NVML
        # accounts to the server
        if utilization is not None and not tenant.mps_clients:
            pending += [(TENANT_SM, tenant.sm, labels), (TENANT_MEMORY_COPY, tenant.memory_copy, labels)]
    if used_memory is not None:
        held = sum(m or 0 for m in memory.values())
        pending.append((UNATTRIBUTED, max(0, used_memory - held), {}))
    return pending
