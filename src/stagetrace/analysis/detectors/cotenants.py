"""A co-tenant of the stage's GPU whose use rose while the stage ran (``analysis.tenants``): another pod's SM,
memory-copy or memory burst on the GPU that MPS or time-slicing shares with the request.

Like the error-class signals, per TP rank on each rank's own GPU, and weighed against the baseline: the same
tenant's rise on the baseline's span as well (both ran beside the same burst) makes it weak evidence. So does a span
that names no pod of its own, whose rise may be the request's own pod at work.
"""

from __future__ import annotations

from stagetrace import conventions
from stagetrace.analysis.causes import Cause
from stagetrace.analysis.detectors import Case, register
from stagetrace.analysis.detectors.hardware import BOTH_ROSE_WEIGHT
from stagetrace.analysis.tenants import Tenancy, TenantRise, gpus_of

UNKNOWN_OWN_WEIGHT = BOTH_ROSE_WEIGHT  # a rise that may be the request's own pod weighs as little as a shared one


def _kind(rise: TenantRise) -> tuple[str, str, str]:
    return rise.use.spec.name, rise.namespace, rise.pod


@register
class CoTenants:
    name = "cotenants"

    def detect(self, case: Case) -> list[Cause]:
        spans = [
            s for s in (*case.spans.values(), *case.baseline_spans.values()) if s.attributes.get(conventions.GPU_UUID)
        ]
        if not spans:
            return []
        tenancy = case.tenancy
        if tenancy is None:
            tenancy = Tenancy(
                case.store,
                gpus_of(spans),
                min(s.start_ns for s in spans),
                max(s.start_ns + s.duration_ns for s in spans),
            )
        causes = []
        for rank, span in sorted(case.spans.items()):
            theirs = case.baseline_spans.get(rank)
            baseline = {
                _kind(r): r.during for r in (tenancy.rises(theirs) if theirs is not None else ()) if r.own is not True
            }
            for rise in tenancy.rises(span):
                if rise.own:
                    continue
                both = _kind(rise) in baseline
                weight = (BOTH_ROSE_WEIGHT if both else 1.0) * (UNKNOWN_OWN_WEIGHT if rise.own is None else 1.0)
                evidence = {
                    "host": rise.host,
                    "device": rise.device,
                    "rank": rank or None,
                    "tenant": rise.tenant,
                    "labels": {"namespace": rise.namespace, "pod": rise.pod},
                    "sharing": rise.sharing,
                    "before": rise.before,
                    "during": rise.during,
                    "window_ns": list(rise.window),
                }
                if rise.own is None:
                    evidence["own_pod"] = "unknown: the span names no k8s.pod.name or k8s.pod.uid"
                causes.append(
                    Cause(
                        "hardware",
                        case.stage,
                        rise.use.spec.name,
                        f"{rise.during:g}",
                        f"{baseline.get(_kind(rise), 0.0):g}",
                        rise.use.severity * weight,
                        evidence,
                        weak=both or rise.own is None,
                    )
                )
        return causes
