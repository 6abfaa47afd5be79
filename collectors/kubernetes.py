"""Kubernetes collector: which pod holds which GPU, as the kubelet's PodResources API says.

The scheduler's view beside the hardware's. The kubelet serves ``v1.PodResourcesLister`` over gRPC
on a unix socket, ``/var/lib/kubelet/pod-resources/kubelet.sock`` (kubernetes/kubernetes,
``staging/src/k8s.io/kubelet/pkg/apis/podresources/v1``: ``api.proto`` and ``constants.go``'s
``PodResourcesSocket``). Two calls, each with a 2 s deadline, on a plain channel ``unix:<socket>``:

- ``GetAllocatableResources``: every device the device plugins registered, as ``ContainerDevices``
  (``resource_name`` = 1, ``device_ids`` = 2, ``topology`` = 3): what the node advertises, and what
  the scheduler counts as its capacity of each resource.
- ``List``: each running pod (``PodResources``: ``name`` = 1, ``namespace`` = 2, ``containers`` = 3)
  and each container's devices (``ContainerResources``: ``name`` = 1, ``devices`` = 2, ``cpu_ids``
  = 3, ``memory`` = 4, ``dynamic_resources`` = 5): what is allocated, to whom.

The messages are defined in ``podresources/api.proto`` from the published API (see that package for
why no code is generated).

**Shared GPUs.** NVIDIA's device plugin (NVIDIA/k8s-device-plugin) shares a GPU by advertising it
as several devices: with time-slicing or MPS ``replicas: N`` each GPU becomes N devices whose IDs
are the GPU's ID annotated with a replica number, ``<GPU-UUID>::<n>`` (``internal/rm/devices.go``:
``NewAnnotatedID`` formats ``%s::%d``, ``AnnotatedID.GetID`` splits at the first ``::``), under the
resource ``nvidia.com/gpu``, or ``nvidia.com/gpu.shared`` with ``renameByDefault: true``
(``api/config/v1``: ``DefaultSharedResourceNameSuffix = ".shared"``). This collector resolves every
device ID the same way, to the part before ``::``: the physical GPU (a MIG device's ID is its MIG
UUID, its own physical unit; with the plugin's ``deviceIDStrategy: index`` the IDs, and so the
``uuid`` label, are GPU indexes). Devices assigned through Dynamic Resource Allocation are not
extended resources and are not counted.

Series (``host`` added by the node), for the GPU resources (``--gpu-resources``: names or shell
patterns, default ``nvidia.com/gpu*`` and ``nvidia.com/mig-*``):

- ``k8s_gpu_allocatable_devices{resource}``: devices the node advertises (the scheduler's capacity);
- ``k8s_gpu_physical_devices{resource}``: distinct physical GPUs behind them;
- ``k8s_gpu_allocated_devices{resource}``: devices allocated to containers (the scheduler's used);
- ``k8s_gpu_allocation_info{uuid,resource,namespace,pod,container,device_id}``: one per allocation;
- ``k8s_gpu_allocations_per_physical{uuid}``: allocations on each physical GPU (0 for a free one);
- ``k8s_gpu_sharing_factor``: allocations per physical GPU the operator intends
  (``--gpu-sharing-factor``, default 1), so the rules compare the node's state with it;
- ``k8s_podresources_errors_total{method}``: calls that failed (the log says how).

With ``gpu_up`` and ``mps_clients`` they answer: how many physical GPUs, how many allocations on
each, how many MPS clients on each, and whether the node advertises more devices than it has GPUs
× the sharing factor: the state in which a scheduler reports a one-GPU node shared by two pods as
``used: 2, capacity: 1`` and closes it to further pods. :func:`diagnose` names it in one line
(``stagetrace collect`` prints it on stderr).

No socket → SourceUnavailable (not a Kubernetes node; the collector runs by default only where the
socket exists). A kubelet that refuses (UNAVAILABLE, PERMISSION_DENIED), times out, or answers
``List`` with bytes that are not a ``ListPodResourcesResponse`` → SourceUnavailable naming the
status, and the call is counted. A failed ``GetAllocatableResources`` (older kubelets answer
UNIMPLEMENTED) is counted and logged once; the allocations are still reported, without the
allocatable series.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stagetrace.collectors.base import (
    COUNTER,
    GAUGE,
    INFO,
    Collector,
    MetricSpec,
    Options,
    Samples,
    Setting,
    SourceUnavailable,
    comma_list,
    register,
)
from stagetrace.environment_variables import (
    STAGETRACE_GPU_RESOURCES,
    STAGETRACE_GPU_SHARING_FACTOR,
    STAGETRACE_KUBELET_SOCKET,
)

if TYPE_CHECKING:
    import grpc

# gRPC and the PodResources messages (stagetrace.collectors.podresources) are imported at the first scrape, not
# with the module: `collect --help` and a node without this collector do not pay for them.

logger = logging.getLogger("stagetrace.collectors.kubernetes")

KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"  # the kubelet's PodResourcesSocket

CALL_TIMEOUT_S = 2.0
REPLICA_SEPARATOR = "::"  # NVIDIA's AnnotatedID: <device ID>::<replica>

ALLOCATABLE = MetricSpec(
    "k8s_gpu_allocatable_devices",
    GAUGE,
    "Devices of the GPU resource the kubelet advertises (GetAllocatableResources): the scheduler's capacity.",
    ("resource",),
)
PHYSICAL = MetricSpec(
    "k8s_gpu_physical_devices",
    GAUGE,
    "Distinct physical GPUs behind the resource's advertised devices (replica IDs <uuid>::<n> resolved).",
    ("resource",),
)
ALLOCATED = MetricSpec(
    "k8s_gpu_allocated_devices",
    GAUGE,
    "Devices of the GPU resource allocated to containers (List): the scheduler's used.",
    ("resource",),
)
ALLOCATION = MetricSpec(
    "k8s_gpu_allocation_info",
    INFO,
    "A device of a GPU resource allocated to a container, and its physical GPU.",
    ("uuid", "resource", "namespace", "pod", "container", "device_id"),
)
PER_PHYSICAL = MetricSpec(
    "k8s_gpu_allocations_per_physical",
    GAUGE,
    "Devices allocated on the physical GPU, whatever their replica IDs: 2 for one card two pods share.",
    ("uuid",),
)
SHARING_FACTOR = MetricSpec(
    "k8s_gpu_sharing_factor",
    GAUGE,
    "Allocations per physical GPU the operator intends (--gpu-sharing-factor): MPS or time-slicing replicas.",
)
ERRORS = MetricSpec(
    "k8s_podresources_errors_total", COUNTER, "PodResources calls to the kubelet that failed, by method.", ("method",)
)

METHODS = ("List", "GetAllocatableResources")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{text!r} is not a whole number of 1 or more")
    return value


SOCKET = Setting(
    "kubelet_socket",
    Path,
    KUBELET_SOCKET,
    env=STAGETRACE_KUBELET_SOCKET,
    flag="--kubelet-socket",
    metavar="PATH",
    help="the kubelet's PodResources socket; the kubernetes collector runs by default where it exists",
)
GPU_RESOURCES = Setting(
    "gpu_resources",
    comma_list,
    "nvidia.com/gpu*,nvidia.com/mig-*",
    env=STAGETRACE_GPU_RESOURCES,
    flag="--gpu-resources",
    metavar="PATTERNS",
    help="extended resources that are GPUs, comma-separated names or shell patterns",
)
GPU_SHARING_FACTOR = Setting(
    "gpu_sharing_factor",
    positive_int,
    "1",
    env=STAGETRACE_GPU_SHARING_FACTOR,
    flag="--gpu-sharing-factor",
    metavar="N",
    help="allocations per physical GPU you intend (the MPS or time-slicing replicas); more is an alert",
)


def physical_id(device_id: str) -> str:
    """The physical device of a device ID: the part before ``::`` (NVIDIA's replica annotation), else the ID."""
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class Allocation:
    resource: str
    namespace: str
    pod: str
    container: str
    device_id: str

    @property
    def uuid(self) -> str:
        return physical_id(self.device_id)


def _status(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'error'}: {details}"


def _why(method: str, exc: Exception) -> str:
    from stagetrace.collectors import podresources

    return f"the answer is no {method} response ({exc})" if isinstance(exc, podresources.DecodeError) else _status(exc)


@register
class KubernetesCollector(Collector):
    """The kubelet's PodResources: GPU devices advertised, and allocated to each pod and container."""

    name = "kubernetes"
    default_enabled = False  # unless the kubelet's socket exists (enabled_by_default)
    settings = (SOCKET, GPU_RESOURCES, GPU_SHARING_FACTOR)

    def __init__(self, options: Options):
        super().__init__(options)
        self.socket = Path(options.kubelet_socket)
        self.patterns = tuple(options.gpu_resources)
        self.sharing_factor = options.gpu_sharing_factor
        self._channel: grpc.Channel | None = None  # opened at the first scrape: no gRPC state before a fork
        self._errors = dict.fromkeys(METHODS, 0)
        self._said: dict[str, str] = {}

    @classmethod
    def enabled_by_default(cls, options: Options) -> bool:
        return Path(options.kubelet_socket).exists()

    def is_gpu(self, resource: str) -> bool:
        return any(fnmatch.fnmatchcase(resource, pattern) for pattern in self.patterns)

    def _call(self, method: str):
        import grpc
        from stagetrace.collectors import podresources

        if self._channel is None:
            self._channel = podresources.channel(self.socket)
        try:
            return podresources.call(self._channel, method, timeout=CALL_TIMEOUT_S)
        except (grpc.RpcError, podresources.DecodeError) as exc:
            self._errors[method] += 1
            self.close()  # a fresh channel next time, without the failed one's reconnect back-off
            raise _CallFailed(f"kubelet PodResources {method} at {self.socket} failed: {_why(method, exc)}") from None

    def collect(self, out: Samples) -> None:
        if not self.socket.exists():
            raise SourceUnavailable(f"no kubelet PodResources socket at {self.socket} (not a Kubernetes node?)")
        try:
            listed = self._call("List")
        except _CallFailed as exc:
            raise SourceUnavailable(str(exc)) from None
        try:
            allocatable = self._call("GetAllocatableResources")
        except _CallFailed as exc:
            self._say_once("allocatable", f"{exc}; reporting allocations without k8s_gpu_allocatable_devices")
            allocatable = None
        else:
            if self._said.pop("allocatable", None) is not None:
                logger.info("kubernetes: GetAllocatableResources answers again")
        self._emit(out, self._allocations(listed), allocatable)

    def _say_once(self, topic: str, message: str) -> None:
        if self._said.get(topic) != message:
            self._said[topic] = message
            logger.warning("kubernetes: %s", message)

    def _allocations(self, listed) -> list[Allocation]:
        found = {
            Allocation(devices.resource_name, pod.namespace, pod.name, container.name, device_id)
            for pod in listed.pod_resources
            for container in pod.containers
            for devices in container.devices
            if self.is_gpu(devices.resource_name)
            for device_id in devices.device_ids
            if device_id
        }
        return sorted(found, key=lambda a: (a.uuid, a.device_id, a.namespace, a.pod, a.container))

    def _emit(self, out: Samples, allocations: list[Allocation], allocatable) -> None:
        advertised: dict[str, set[str]] = defaultdict(set)
        for devices in allocatable.devices if allocatable is not None else ():
            if self.is_gpu(devices.resource_name):
                advertised[devices.resource_name].update(d for d in devices.device_ids if d)
        allocated: dict[str, set[str]] = defaultdict(set)
        per_physical: dict[str, set[tuple[str, str]]] = {
            physical_id(d): set() for ids in advertised.values() for d in ids
        }
        for a in allocations:
            allocated[a.resource].add(a.device_id)
            per_physical.setdefault(a.uuid, set()).add((a.resource, a.device_id))
        if allocatable is not None:
            for resource in sorted(advertised):
                out.add(ALLOCATABLE, len(advertised[resource]), resource=resource)
                out.add(PHYSICAL, len({physical_id(d) for d in advertised[resource]}), resource=resource)
        for resource in sorted(advertised.keys() | allocated.keys()):
            out.add(ALLOCATED, len(allocated.get(resource, ())), resource=resource)
        for a in allocations:
            out.add(
                ALLOCATION,
                {},
                uuid=a.uuid,
                resource=a.resource,
                namespace=a.namespace,
                pod=a.pod,
                container=a.container,
                device_id=a.device_id,
            )
        for uuid in sorted(per_physical):
            out.add(PER_PHYSICAL, len(per_physical[uuid]), uuid=uuid)
        out.add(SHARING_FACTOR, self.sharing_factor)
        for method, count in self._errors.items():
            out.add(ERRORS, count, method=method)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class _CallFailed(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# The one-line diagnosis


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# the series diagnose() reads: the agent builds families of these alone at each scrape
DIAGNOSIS_INPUTS = frozenset(
    {
        SHARING_FACTOR.name,
        ALLOCATION.name,
        PER_PHYSICAL.name,
        PHYSICAL.name,
        ALLOCATED.name,
        ALLOCATABLE.name,
        "mps_clients",
        "gpu_up",
    }
)


def diagnose(families: Iterable) -> str | None:
    """One line naming a double-counted or over-allocated GPU in one node's scrape, or None when there is none.

    Reads the kubernetes collector's series, and ``gpu_up`` and ``mps_clients`` of the same scrape when
    present: physical GPUs allocated more often than ``k8s_gpu_sharing_factor``, with their pods and MPS
    clients; resources advertised as more (or fewer) devices than physical GPUs × the factor; more devices
    allocated than advertised; and NVML's count of GPUs where it differs from the kubelet's.
    """
    samples: dict[str, list] = defaultdict(list)
    for family in families:
        for sample in family.samples:
            samples[sample.name].append(sample)
    if not samples.get(SHARING_FACTOR.name):
        return None  # the kubernetes collector did not report in this scrape
    factor = int(samples[SHARING_FACTOR.name][0].value)
    pods: dict[str, set[str]] = defaultdict(set)
    for s in samples[ALLOCATION.name]:
        pods[s.labels["uuid"]].add(f"{s.labels['namespace']}/{s.labels['pod']}")
    mps = {s.labels["uuid"]: int(s.value) for s in samples.get("mps_clients", ())}
    nvml = {s.labels["uuid"] for s in samples.get("gpu_up", ())}
    parts = []
    for s in sorted(samples[PER_PHYSICAL.name], key=lambda s: s.labels["uuid"]):
        uuid, count = s.labels["uuid"], int(s.value)
        if count > factor:
            held = sorted(pods[uuid])
            text = f"{uuid} is allocated {_plural(count, 'time')} ({_plural(len(held), 'pod')}: {', '.join(held)})"
            if uuid in mps:
                text += f" with {_plural(mps[uuid], 'MPS client')}"
            parts.append(text)
    physical = {s.labels["resource"]: int(s.value) for s in samples.get(PHYSICAL.name, ())}
    allocated = {s.labels["resource"]: int(s.value) for s in samples.get(ALLOCATED.name, ())}
    for s in sorted(samples.get(ALLOCATABLE.name, ()), key=lambda s: s.labels["resource"]):
        resource, devices = s.labels["resource"], int(s.value)
        gpus = physical.get(resource, 0)
        seen = f" (NVML sees {len(nvml)})" if nvml and len(nvml) != gpus else ""
        text = f"the node advertises {_plural(devices, resource + ' device')} for {_plural(gpus, 'physical GPU')}{seen}"
        if gpus and devices > gpus * factor:
            per_gpu = devices // gpus if devices % gpus == 0 else None
            counts = (
                f"the scheduler counts {'it' if gpus == 1 else 'each'} {_times(per_gpu)}"
                if per_gpu
                else (f"{devices - gpus * factor} more than the sharing factor {factor} allows")
            )
            parts.append(f"{text}: {counts}")
        elif gpus and devices < gpus * factor:
            parts.append(f"{text}: fewer than the sharing factor {factor} expects")
        if allocated.get(resource, 0) > devices:
            used = allocated[resource]
            parts.append(
                f"the node allocated {_plural(used, resource + ' device')} and advertises {devices}: "
                f"used: {used}, capacity: {devices}"
            )
    return "; ".join(parts) or None
