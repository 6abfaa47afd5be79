"""Which pods held a GPU: the kubernetes collector's ``k8s_gpu_allocation_info`` samples, joined to spans.

A span names its GPU (``gpu.uuid``) and, under the OpenTelemetry Kubernetes conventions, its own pod (resource
``k8s.pod.name`` and ``k8s.namespace.name``). The kubelet's allocations say which pods held that physical GPU
around the time, so ``trace`` shows which pod on which GPU served a request, and MPS co-tenancy as a cause
names the pods that shared the GPU with it.
"""

from __future__ import annotations

from stagetrace.conventions import GPU_UUID, HOST

POD, NAMESPACE = "k8s.pod.name", "k8s.namespace.name"
# Allocations change when pods come and go, not between scrapes: the samples this long before a span still say
# who held its GPU while it ran.
LOOKBACK_NS = 600 * 1_000_000_000

HOLDERS_SQL = """
SELECT ResourceAttributes['host.name'] AS Host, Attributes['uuid'] AS Uuid,
       arraySort(groupUniqArray(concat(Attributes['namespace'], '/', Attributes['pod']))) AS Pods
FROM {db:Identifier}.otel_metrics_gauge
WHERE MetricName = 'k8s_gpu_allocation_info' AND ResourceAttributes['host.name'] IN {hosts:Array(String)}
  AND Attributes['uuid'] IN {uuids:Array(String)}
  AND TimeUnix >= fromUnixTimestamp64Nano({t0:Int64}) AND TimeUnix <= fromUnixTimestamp64Nano({t1:Int64})
GROUP BY Host, Uuid
"""


def own_pod(span) -> str:
    """``namespace/pod`` of the span's resource, or ``""``."""
    pod = span.resource.get(POD, "")
    return f"{span.resource.get(NAMESPACE, '')}/{pod}" if pod else ""


def holders(store, spans, start_ns: int, end_ns: int) -> dict[tuple[str, str], list[str]]:
    """``{(host, gpu uuid): ["namespace/pod", ...]}`` for the GPUs the spans name, from the allocations seen
    from ``LOOKBACK_NS`` before ``start_ns`` to ``end_ns``; {} without the kubernetes collector's samples."""
    gpus = {(s.resource.get(HOST, ""), s.attributes[GPU_UUID]) for s in spans if s.attributes.get(GPU_UUID)}
    if not gpus:
        return {}
    rows = store.client.query(
        HOLDERS_SQL,
        parameters={
            "db": store.database,
            "hosts": sorted({h for h, _ in gpus}),
            "uuids": sorted({u for _, u in gpus}),
            "t0": start_ns - LOOKBACK_NS,
            "t1": end_ns,
        },
    ).result_rows
    return {(host, uuid): list(pods) for host, uuid, pods in rows if (host, uuid) in gpus}


def gpu_pods(store, trace) -> list[dict]:
    """Per GPU a trace's spans ran on: the pods that held it, and the pod of the spans that ran there."""
    held = holders(store, trace.spans, trace.start_ns, trace.start_ns + trace.duration_ns)
    out = []
    for (host, uuid), pods in sorted(held.items()):
        served = sorted(
            {own_pod(s) for s in trace.spans if s.attributes.get(GPU_UUID) == uuid and s.resource.get(HOST, "") == host}
            - {""}
        )
        out.append({"host": host, "gpu": uuid, "held_by": pods, "served_by": served})
    return out
