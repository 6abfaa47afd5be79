"""The other tenants of a stage's GPU: whose use of a shared GPU rose while the stage ran.

The gpu collector writes, per physical GPU and pod, the pod's device memory, its SM and memory-copy utilization
(NVML's per-process samples, summed over the pod's processes) and its MPS client processes
(``gpu_tenant_*``, ``stagetrace.tenant_metrics``). A tenant's use *rose while the stage ran* when its highest value
at the scrapes whose intervals overlap the stage (from the first scrape after the last one at or before the
stage's start, to the first at or after its end) is at least ``Use.min_rise`` above its usual level and
``Use.min_ratio`` times it. Its usual level is the median of its values at the GPU's scrapes over the
``LOOKAROUND_NS`` before the window, a tenant absent at a scrape counting 0 (no processes: no memory, no SMs),
from at least ``MIN_TYPICAL`` scrapes. Only the time before counts: a burst that began with the stage and went on
afterwards is still a rise, and one that ended before the stage is not.

Whose use is not a co-tenant's:
- The request's own pod: the span's resource ``k8s.pod.name`` (with ``k8s.namespace.name`` when given) or
  ``k8s.pod.uid`` (a pod the kubelet's log directory did not name is ``uid:<UID>`` in the series). A span that
  names no pod leaves its own tenant unknown: a tenant's rise may then be the request's own work, so it is named
  as weak evidence only, never as the verdict.
- Under MPS, NVML samples the utilization of the MPS server alone, whose work is every client's: the SM and
  memory-copy series of the pod holding the MPS server (``gpu_process_info{role="mps_server"}``) are the whole
  GPU's, the request's included; under MPS only device memory names a co-tenant.
- A GPU with one tenant in the window has no co-tenant.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from stagetrace import conventions
from stagetrace.analysis.hardware import DEVICE_LABELS, GPU, LOOKAROUND_NS, MIN_TYPICAL
from stagetrace.metrics import MetricSpec
from stagetrace.tenant_metrics import (
    MPS_SERVER,
    PROCESS,
    TENANT_MEMORY,
    TENANT_MEMORY_COPY,
    TENANT_MPS_CLIENTS,
    TENANT_PROCESSES,
    TENANT_SM,
    UID_POD,
)

POD, NAMESPACE, POD_UID = "k8s.pod.name", "k8s.namespace.name", "k8s.pod.uid"
GIB = 2**30


@dataclass(frozen=True)
class Use:
    """One kind of use of a GPU by a tenant, and how far it must rise to count."""

    spec: MetricSpec
    words: str  # how a verdict names it
    min_rise: float  # in the series' unit: at least this above the usual level...
    min_ratio: float  # ...and this many times it
    severity: float
    server_accounted: bool  # NVML's per-process samples: under MPS the server's, every client's work together


# Below the error-class signals (XID, ECC, RDMA errors): contention slows a stage and changes what an engine batches
# and evicts, but corrupts nothing. SM above memory: a compute burst contends on every kernel of the stage. A quarter
# of the GPU's SMs and 1 GiB are judgements (an increase a co-tenant's job start or a batch makes; jitter does not).
USES = (
    Use(TENANT_SM, "SM utilization", 0.25, 2.0, 0.55, True),
    Use(TENANT_MEMORY_COPY, "memory-copy utilization", 0.25, 2.0, 0.5, True),
    Use(TENANT_MEMORY, "device memory", 1.0 * GIB, 1.5, 0.5, False),
)
_BY_NAME = {use.spec.name: use for use in USES}
_PRESENCE = (TENANT_PROCESSES.name, TENANT_MEMORY.name)  # written for every tenant at every scrape

TENANTS_SQL = f"""
SELECT ResourceAttributes['{conventions.HOST}'] AS Host, Attributes['{DEVICE_LABELS[GPU]}'] AS Uuid, MetricName,
       Attributes['namespace'] AS Namespace, Attributes['pod'] AS Pod, {conventions.time_ns_sql("TimeUnix")} AS T,
       Value
FROM {{db:Identifier}}.otel_metrics_gauge
WHERE MetricName IN {{names:Array(String)}}
  AND ResourceAttributes['{conventions.HOST}'] IN {{hosts:Array(String)}}
  AND Attributes['{DEVICE_LABELS[GPU]}'] IN {{uuids:Array(String)}}
  AND TimeUnix >= fromUnixTimestamp64Nano({{t0:Int64}}) AND TimeUnix <= fromUnixTimestamp64Nano({{t1:Int64}})
  AND (MetricName != {{process:String}} OR Attributes['role'] = {{server:String}})
ORDER BY T
"""


def gpus_of(spans) -> set[tuple[str, str]]:
    """The (host, GPU UUID) pairs the spans ran on, of those that name a GPU."""
    return {
        (s.resource.get(conventions.HOST, ""), s.attributes[conventions.GPU_UUID])
        for s in spans
        if s.attributes.get(conventions.GPU_UUID)
    }


def tenant_name(namespace: str, pod: str) -> str:
    return f"{namespace}/{pod}" if pod else "(processes in no pod)"


def is_own(resource: dict[str, str], namespace: str, pod: str) -> bool | None:
    """Whether the tenant ``namespace``/``pod`` is the span's own pod; None when the span names no pod."""
    name, uid = resource.get(POD, ""), resource.get(POD_UID, "")
    if not name and not uid:
        return None
    if uid and pod == f"{UID_POD}{uid}":
        return True
    return bool(name) and pod == name and resource.get(NAMESPACE, namespace) == namespace


@dataclass
class TenantRise:
    use: Use
    host: str
    device: str  # the GPU's UUID
    namespace: str
    pod: str
    before: float  # the tenant's usual level before the window
    during: float  # its highest value in the window
    sharing: str  # "MPS" or "time-slicing"
    window: tuple[int, int]
    own: bool | None  # the span's own pod (None: the span names none)

    @property
    def tenant(self) -> str:
        return tenant_name(self.namespace, self.pod)


@dataclass
class _Gpu:
    """One GPU's tenant series, indexed once so that asking per stage window costs what the window holds."""

    series: dict[tuple[str, str, str], dict[int, float]]  # (metric, namespace, pod) -> {time: value}
    servers: set[tuple[str, str]]  # the pods holding its MPS server
    scrapes: list[int] = field(init=False)  # times at which any tenant was written, in order
    sampled: dict[str, set[int]] = field(init=False)  # metric -> the scrapes at which some tenant had it
    mps_at: list[int] = field(init=False)  # the scrapes at which MPS had clients, in order

    def __post_init__(self):
        self.scrapes = sorted({t for (name, _, _), values in self.series.items() if name in _PRESENCE for t in values})
        self.sampled = defaultdict(set)
        for (name, _, _), values in self.series.items():
            self.sampled[name].update(values)
        self.mps_at = sorted(
            t
            for (name, _, _), values in self.series.items()
            if name == TENANT_MPS_CLIENTS.name
            for t, v in values.items()
            if v > 0
        )


class Tenancy:
    """The tenant series of some GPUs over a time range, read in one query, asked per stage window (one read serves
    every request a ``divergences`` pass analyses)."""

    def __init__(self, store, gpus: Iterable[tuple[str, str]], t0_ns: int, t1_ns: int):
        gpus = set(gpus)
        series: dict[tuple[str, str], dict[tuple[str, str, str], dict[int, float]]] = defaultdict(dict)
        servers: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
        self._gpus: dict[tuple[str, str], _Gpu] = {}
        if not gpus:
            return
        names = sorted({*_BY_NAME, *_PRESENCE, TENANT_MPS_CLIENTS.name, PROCESS.name})
        rows = store.client.query(
            TENANTS_SQL,
            parameters={
                "db": store.database,
                "names": names,
                "hosts": sorted({h for h, _ in gpus}),
                "uuids": sorted({u for _, u in gpus}),
                "t0": t0_ns - LOOKAROUND_NS,
                "t1": t1_ns + LOOKAROUND_NS,
                "process": PROCESS.name,
                "server": MPS_SERVER,
            },
        ).result_rows
        for host, uuid, name, namespace, pod, t, value in rows:
            if (host, uuid) not in gpus:
                continue
            if name == PROCESS.name:
                servers[(host, uuid)].add((namespace, pod))
            else:
                series[(host, uuid)].setdefault((name, namespace, pod), {})[t] = value
        self._gpus = {gpu: _Gpu(tenants, servers.get(gpu, set())) for gpu, tenants in series.items()}

    def series(self, host: str, uuid: str, name: str, namespace: str, pod: str) -> tuple[list[int], list[float]]:
        """One tenant's samples of ``name`` on the GPU, in time order."""
        gpu = self._gpus.get((host, uuid))
        values = gpu.series.get((name, namespace, pod), {}) if gpu else {}
        return sorted(values), [values[t] for t in sorted(values)]

    def rises(self, span) -> list[TenantRise]:
        """The tenants of the span's GPU whose use rose while it ran, the span's own pod included (``own``)."""
        host, uuid = span.resource.get(conventions.HOST, ""), span.attributes.get(conventions.GPU_UUID, "")
        gpu = self._gpus.get((host, uuid))
        if gpu is None:
            return []
        scrapes = gpu.scrapes
        first = bisect.bisect_right(scrapes, span.start_ns) - 1
        last = bisect.bisect_left(scrapes, span.start_ns + span.duration_ns)
        if first < 0 or last >= len(scrapes):
            return []  # no scrape before the stage, or none since it ended: no window to judge
        w0, w1 = scrapes[first], scrapes[last]
        during = scrapes[first + 1 : last + 1]
        before = scrapes[bisect.bisect_left(scrapes, w0 - LOOKAROUND_NS) : first + 1]
        present = {
            (ns, pod)
            for (name, ns, pod), values in gpu.series.items()
            if name in _PRESENCE and any(t in values for t in during)
        }
        if len(present) < 2 or len(before) < MIN_TYPICAL:
            return []
        mps_from = bisect.bisect_left(gpu.mps_at, w0 - LOOKAROUND_NS)
        mps = mps_from < len(gpu.mps_at) and gpu.mps_at[mps_from] <= w1
        out = []
        for (name, ns, pod), values in gpu.series.items():
            use = _BY_NAME.get(name)
            if use is None or (ns, pod) not in present or (use.server_accounted and (ns, pod) in gpu.servers):
                continue
            # a scrape at which no tenant has this series (NVML did not answer that call) says nothing of anyone
            sampled = gpu.sampled[name]
            usual = [values.get(t, 0.0) for t in before if t in sampled]
            now = [values.get(t, 0.0) for t in during if t in sampled]
            if len(usual) < MIN_TYPICAL or not now:
                continue
            level, peak = statistics.median(usual), max(now)
            if peak - level >= use.min_rise and peak >= use.min_ratio * level:
                out.append(
                    TenantRise(
                        use,
                        host,
                        uuid,
                        ns,
                        pod,
                        level,
                        peak,
                        "MPS" if mps else "time-slicing",
                        (w0, w1),
                        is_own(span.resource, ns, pod),
                    )
                )
        # strongest first: each use's largest rise relative to what it must rise by
        return sorted(out, key=lambda r: (-r.use.severity, -(r.during - r.before) / r.use.min_rise, r.tenant))


def amount(value: float, spec: MetricSpec) -> str:
    if spec.unit == "bytes":
        return f"{value / GIB:.1f} GiB"
    if spec.unit == "ratio":
        return f"{value:.0%}"
    return f"{value:g}"


def describe(metric: str, evidence: dict) -> str:
    """``GPU-… (host) is shared by MPS with batch/worker-0, whose SM utilization rose from 5% to 80%``: a co-tenant
    cause's ``metric`` (its name) and evidence."""
    use = _BY_NAME[metric]
    return (
        f"{evidence['device']} ({evidence['host']}) is shared by {evidence['sharing']} with {evidence['tenant']}, "
        f"whose {use.words} rose from {amount(evidence['before'], use.spec)} to "
        f"{amount(evidence['during'], use.spec)}"
    )
