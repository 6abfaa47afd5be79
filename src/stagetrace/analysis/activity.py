"""How busy a span's GPU was while it ran: SM, tensor and DRAM activity from the gpu collector's GPM series.

Context, not a cause: ``stagetrace trace`` shows it beside the stages, the incident report charts it around the
divergent stage. A GPM value covers the interval since the scrape before it, so the values that describe a span are
those of the scrapes from the first after the last one at or before its start to the first at or after its end
(the same window as ``analysis.tenants``); a span's activity is their mean. The whole GPU's series only
(``gpu_instance`` empty): a span names a GPU, not a MIG instance. GPUs without GPM have none, and show none.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from statistics import fmean

from stagetrace import conventions
from stagetrace.analysis.hardware import DEVICE_LABELS, GPU, LOOKAROUND_NS, devices
from stagetrace.gpm_metrics import GPM_METRICS

# shown, in this order, under these column names
SHOWN = {
    "sm_active": "gpu_sm_active_ratio",
    "tensor_active": "gpu_tensor_active_ratio",
    "dram_active": "gpu_dram_bandwidth_active_ratio",
}
_SPECS = {m.spec.name: m.spec for m in GPM_METRICS}
NAMES = tuple(_SPECS[name].name for name in SHOWN.values())  # a renamed series fails here, not silently

ACTIVITY_SQL = f"""
SELECT ResourceAttributes['{conventions.HOST}'] AS Host, Attributes['{DEVICE_LABELS[GPU]}'] AS Uuid, MetricName,
       {conventions.time_ns_sql("TimeUnix")} AS T, Value
FROM {{db:Identifier}}.otel_metrics_gauge
WHERE MetricName IN {{names:Array(String)}}
  AND ResourceAttributes['{conventions.HOST}'] IN {{hosts:Array(String)}}
  AND Attributes['{DEVICE_LABELS[GPU]}'] IN {{uuids:Array(String)}} AND Attributes['gpu_instance'] = ''
  AND TimeUnix >= fromUnixTimestamp64Nano({{t0:Int64}}) AND TimeUnix <= fromUnixTimestamp64Nano({{t1:Int64}})
ORDER BY T
"""


class Activity:
    """The GPM series of some GPUs over a time range (one query), asked per span."""

    def __init__(self, store, gpus: Iterable[tuple[str, str]], t0_ns: int, t1_ns: int):
        gpus = set(gpus)
        self._series: dict[tuple[str, str, str], tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        if not gpus:
            return
        rows = store.client.query(
            ACTIVITY_SQL,
            parameters={
                "db": store.database,
                "names": list(NAMES),
                "hosts": sorted({h for h, _ in gpus}),
                "uuids": sorted({u for _, u in gpus}),
                "t0": t0_ns - LOOKAROUND_NS,
                "t1": t1_ns + LOOKAROUND_NS,
            },
        ).result_rows
        for host, uuid, name, t, value in rows:
            times, values = self._series[(host, uuid, name)]
            times.append(t)
            values.append(value)

    def series(self, host: str, uuid: str, name: str) -> tuple[list[int], list[float]]:
        return self._series.get((host, uuid, name), ([], []))

    def during(self, host: str, uuid: str, start_ns: int, end_ns: int) -> dict[str, float]:
        """``{column: mean}`` of each shown series over the scrapes that cover [start, end]."""
        out = {}
        for column, name in SHOWN.items():
            times, values = self.series(host, uuid, name)
            first = bisect.bisect_right(times, start_ns) - 1
            last = bisect.bisect_left(times, end_ns)
            covering = values[first + 1 : last + 1] if first >= 0 and last < len(times) else []
            if covering:
                out[column] = fmean(covering)
        return out


def _gpus(spans) -> list[tuple[object, str, str]]:
    return [
        (span, span.resource.get(conventions.HOST, ""), uuid) for span in spans for uuid in devices(span.attributes)[0]
    ]


def of_trace(store, trace) -> list[dict]:
    """Per span and GPU it names: its GPU's activity while it ran, where the GPU has GPM series."""
    found = _gpus(trace.spans)
    if not found:
        return []
    activity = Activity(store, {(h, u) for _, h, u in found}, trace.start_ns, trace.start_ns + trace.duration_ns)
    out = []
    for span, host, uuid in found:
        values = activity.during(host, uuid, span.start_ns, span.start_ns + span.duration_ns)
        if values:
            out.append(
                {"stage": span.stage or span.name, "rank": span.rank or None, "host": host, "device": uuid, **values}
            )
    return out
