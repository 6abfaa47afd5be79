"""Error-class hardware signals that rose on the devices of every span of the divergent stage while it ran.

Each TP rank's span names its own host (resource ``host.name``), GPU (``gpu.uuid``) and NICs
(``net.rdma.devices``), so the NIC of a rank on another host is looked at as closely as the local one.
A signal scores its severity when it rose for the request and not for the baseline's span of the same
rank, and a fifth of it, as weak evidence, when it rose for both. A transfer over the fabric whose spans name no NIC
(SGLang's KV transfer) is weighed at each end, on each half's host, against the baseline's same end (``fabric``).
"""

from __future__ import annotations

from stagetrace.analysis import fabric, pods
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register
from stagetrace.analysis.hardware import Rise

BOTH_ROSE_WEIGHT = 0.2
CO_TENANCY = "mps_clients"  # another MPS client on the GPU: the kubelet's allocations name its pod
_DEVICE_LABELS = ("uuid", "device", "gpu", "port", "model", "netdev", "interface")


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
            before_by_half: dict[str, dict[tuple, float]] = {}
            for place in fabric.watched(case.baseline, case.stage, theirs, case.samples) if theirs else ():
                before = before_by_half.setdefault(place.half, {})
                for rise in place.rises(case.samples):
                    before[_kind(rise)] = before.get(_kind(rise), 0.0) + rise.delta
            for place in fabric.watched(case.request, case.stage, span, case.samples):
                # each end against the baseline's same end (its prefill's host, its decode's)
                before = before_by_half.get(place.half, {})
                causes += [self._cause(case, rank, place, rise, before) for rise in place.rises(case.samples)]
        return causes

    @staticmethod
    def _cause(case: Case, rank: str, place: fabric.Watched, rise: Rise, before: dict[tuple, float]) -> Cause:
        both = before.get(_kind(rise), 0.0) > 0
        host, span = place.host, place.span
        evidence = {"host": host, "device": rise.device, "rank": rank or None, "labels": rise.labels}
        if place.half:  # one end of a disaggregated request's KV transfer: which
            evidence["half"] = place.half
        if rise.metric == CO_TENANCY:  # the pods that held the GPU beside the request's own
            held = pods.holders(case.store, [span], place.start_ns, place.end_ns)
            others = [p for p in held.get((host, rise.device), []) if p != pods.own_pod(span)]
            if others:
                evidence["co_tenants"] = others
        if rise.timing is not None:  # the window weighed and when in it: what the sentence and chart say
            evidence |= rise.timing.to_json()
        if rise.typical is not None:  # a relative signal: against the series' own usual level
            evidence["typical"] = rise.typical
        sign = "" if rise.signal.is_gauge else "+"
        score = rise.signal.severity * (BOTH_ROSE_WEIGHT if both else 1.0)
        return Cause(
            "hardware",
            case.stage,
            rise.metric,
            f"{sign}{rise.delta:g}",
            f"{sign}{before.get(_kind(rise), 0.0):g}",
            score,
            evidence,
            weak=both,
        )
