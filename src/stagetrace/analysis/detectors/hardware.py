"""Error-class hardware signals that rose on the devices of every span of the divergent stage while it ran.

Each TP rank's span names its own host (resource ``host.name``), GPU (``gpu.uuid``) and NICs
(``net.rdma.devices``), so the NIC of a rank on another host is looked at as closely as the local one.
A signal scores its severity when it rose for the request and not for the baseline's span of the same
rank, and a fifth of it, as weak evidence, when it rose for both.
"""

from __future__ import annotations

from stagetrace.analysis import pods
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register
from stagetrace.analysis.hardware import Rise, devices

BOTH_ROSE_WEIGHT = 0.2
CO_TENANCY = "mps_clients"  # another MPS client on the GPU: the kubelet's allocations name its pod
_DEVICE_LABELS = ("uuid", "device", "gpu", "port", "model", "netdev", "interface")


def _rises(samples, span) -> list[Rise]:
    host = span.resource.get("host.name", "")
    return samples.rises(host, *devices(span.attributes), span.start_ns, span.start_ns + span.duration_ns)


def _kind(rise: Rise) -> tuple:
    return rise.metric, tuple(sorted((k, v) for k, v in rise.labels.items() if k not in _DEVICE_LABELS))


@register
class HardwareSignals:
    name = "hardware"

    def detect(self, case: Case) -> list[Cause]:
        if case.samples is None:
            return []
        causes = []
        for rank, span in sorted(case.spans.items()):
            theirs = case.baseline_spans.get(rank)
            before: dict[tuple, float] = {}
            for rise in _rises(case.samples, theirs) if theirs is not None else ():
                before[_kind(rise)] = before.get(_kind(rise), 0.0) + rise.delta
            host = span.resource.get("host.name", "")
            for rise in _rises(case.samples, span):
                both = before.get(_kind(rise), 0.0) > 0
                evidence = {"host": host, "device": rise.device, "rank": rank or None, "labels": rise.labels}
                if rise.metric == CO_TENANCY:  # the pods that held the GPU beside the request's own
                    held = pods.holders(case.store, [span], span.start_ns, span.start_ns + span.duration_ns)
                    others = [p for p in held.get((host, rise.device), []) if p != pods.own_pod(span)]
                    if others:
                        evidence["co_tenants"] = others
                if rise.timing is not None:  # the window weighed and when in it: what the sentence and chart say
                    evidence |= rise.timing.to_json()
                if rise.typical is not None:  # a relative signal: against the series' own usual level
                    evidence["typical"] = rise.typical
                sign = "" if rise.signal.is_gauge else "+"
                causes.append(Cause("hardware", case.stage, rise.metric, f"{sign}{rise.delta:g}",
                                    f"{sign}{before.get(_kind(rise), 0.0):g}",
                                    rise.signal.severity * (BOTH_ROSE_WEIGHT if both else 1.0), evidence, weak=both))  # fmt: skip
        return causes
