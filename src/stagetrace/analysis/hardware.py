"""Hardware evidence: error-class counters that rose on a stage's GPUs and NICs while it ran.

Signals are described as data (metric, which device label joins it to a span, label filter,
severity). Severity orders causes that rose together: an ack timeout ranks above the retransmits it
causes, an XID above the ECC count behind it. A stage's window runs from the second-to-last scrape
of its host at or before its start (one scrape interval of margin, so an error just before the stage,
whose damage lasts, still counts) to the first scrape at or after its end. Increases are reset-safe: a
decrease is a reset or a 32-bit wrap, and the new value is the increase since. A series that first
appears inside the window, after the host's first scrape, rose from zero (an
``gpu_xid_errors_total{xid}`` series is born at its first event).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from dataclasses import dataclass

from stagetrace.store import Store

GPU, NIC = "gpu", "nic"


@dataclass(frozen=True)
class Signal:
    metric: str  # a metric name, or a regular expression when ``pattern``
    device: str  # GPU series join spans on Attributes['uuid'], NIC series on Attributes['device']
    severity: float
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # label → accepted values
    gauge_above: float | None = None  # a gauge signal: active while its value is above this
    gauge_below: float | None = None
    pattern: bool = False
    # Scrape intervals of margin before the stage: an uncorrectable memory error corrupts until the GPU is reset.
    lookback: int = 1

    def accepts(self, name: str, labels: dict[str, str]) -> bool:
        named = re.fullmatch(self.metric, name) if self.pattern else name == self.metric
        return bool(named) and all(labels.get(k) in values for k, values in self.where)


SIGNALS = (
    Signal("gpu_xid_errors_total", GPU, 1.0, lookback=3),
    Signal("gpu_ecc_errors_total", GPU, 0.95, where=(("type", ("uncorrected",)),), lookback=3),
    Signal("gpu_up", GPU, 0.95, gauge_below=1),
    Signal("gpu_clock_event_active", GPU, 0.6, gauge_above=0,
           where=(("reason", ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")),)),
    Signal("mps_clients", GPU, 0.5, gauge_above=1),  # co-tenancy: another MPS client on the same GPU
    Signal("rdma_link_downed_total", NIC, 0.95),
    Signal("rdma_local_ack_timeout_err_total", NIC, 0.9),
    Signal("rdma_(out_of_sequence|packet_seq_err|implied_nak_seq_err)_total", NIC, 0.85, pattern=True),
    Signal("rdma_(roce_adp_retrans|roce_adp_retrans_to|rnr_nak_retry_err|req_transport_retries_exceeded)_total",
           NIC, 0.8, pattern=True),
    Signal("rdma_(symbol_errors|port_receive_errors|link_error_recovery|local_link_integrity_errors)_total",
           NIC, 0.75, pattern=True),
    Signal("rdma_.*err.*_total", NIC, 0.7, pattern=True),  # any other error-class hw counter
)  # fmt: skip

METRICS_SQL = """
SELECT ResourceAttributes['host.name'] AS Host, MetricName, Attributes, toUnixTimestamp64Nano(TimeUnix), Value
FROM (
    SELECT ResourceAttributes, MetricName, Attributes, TimeUnix, Value
    FROM {db:Identifier}.otel_metrics_sum
    WHERE startsWith(MetricName, 'gpu_') OR startsWith(MetricName, 'rdma_')
    UNION ALL
    SELECT ResourceAttributes, MetricName, Attributes, TimeUnix, Value
    FROM {db:Identifier}.otel_metrics_gauge
    WHERE MetricName IN ('gpu_up', 'gpu_clock_event_active', 'mps_clients')
)
WHERE ResourceAttributes['host.name'] IN {hosts:Array(String)}
  AND TimeUnix >= fromUnixTimestamp64Nano({t0:Int64}) AND TimeUnix <= fromUnixTimestamp64Nano({t1:Int64})
ORDER BY TimeUnix
"""

LOOKAROUND_NS = 10 * 60 * 1_000_000_000  # samples fetched around the windows: enough for a few scrape intervals


@dataclass
class Series:
    signal: Signal
    device: str
    labels: dict[str, str]
    times: list[int]
    values: list[float]


@dataclass
class Rise:
    """A signal that rose (or was active) on a device in a window."""

    signal: Signal
    metric: str
    device: str
    labels: dict[str, str]
    delta: float  # counter increase, or the gauge's extreme value while active


class Samples:
    """Error-class series of some hosts over a time range, fetched once and queried per window."""

    def __init__(self, store: Store, hosts: list[str], t0_ns: int, t1_ns: int):
        params = {"db": store.database, "hosts": sorted(set(hosts)), "t0": t0_ns - LOOKAROUND_NS,
                  "t1": t1_ns + LOOKAROUND_NS}  # fmt: skip
        grouped: dict[tuple, Series] = {}
        self._scrapes: dict[str, set[int]] = defaultdict(set)  # every sample time of a host: its scrape times
        for host, name, labels, t, value in store.client.query(METRICS_SQL, parameters=params).result_rows:
            self._scrapes[host].add(t)
            signal = next((s for s in SIGNALS if s.accepts(name, labels)), None)
            if signal is None:
                continue
            device = labels.get("uuid" if signal.device == GPU else "device", "")
            series = grouped.setdefault((host, name, tuple(sorted(labels.items()))), Series(signal, device, labels, [], []))
            series.times.append(t)
            series.values.append(value)
        self._scrape_times = {host: sorted(times) for host, times in self._scrapes.items()}
        self._by_device: dict[tuple[str, str], list[tuple[str, Series]]] = defaultdict(list)
        for (host, name, _), series in grouped.items():
            self._by_device[(host, series.device)].append((name, series))

    def window(self, host: str, start_ns: int, end_ns: int, lookback: int = 1) -> tuple[int, int] | None:
        """From ``lookback`` scrapes before the last one at or before ``start`` to the first at or after ``end``."""
        scrapes = self._scrape_times.get(host)
        if not scrapes:
            return None
        first = max(bisect.bisect_right(scrapes, start_ns) - 1 - lookback, 0)
        last = min(bisect.bisect_left(scrapes, end_ns), len(scrapes) - 1)
        return scrapes[first], scrapes[last]

    def rises(self, host: str, gpus: list[str], nics: list[str], start_ns: int, end_ns: int) -> list[Rise]:
        if host not in self._scrape_times:
            return []
        born_after = self._scrape_times[host][0]  # a series whose first sample is later was born then
        out = []
        for device in [*gpus, *nics]:
            for name, series in self._by_device.get((host, device), ()):
                delta = _rise(series, *self.window(host, start_ns, end_ns, series.signal.lookback), born_after)
                if delta > 0:
                    out.append(Rise(series.signal, name, device, series.labels, delta))
        return out


def _rise(series: Series, w0: int, w1: int, born_after: int) -> float:
    lo = bisect.bisect_left(series.times, w0)
    hi = bisect.bisect_right(series.times, w1)
    values = series.values[lo:hi]
    if not values:
        return 0.0
    signal = series.signal
    if signal.gauge_above is not None:
        return max((v for v in values if v > signal.gauge_above), default=0.0)
    if signal.gauge_below is not None:
        return 1.0 if any(v < signal.gauge_below for v in values) else 0.0
    increase = values[0] if lo == 0 and series.times[0] > max(w0, born_after) else 0.0
    for previous, value in zip(values, values[1:]):
        increase += value - previous if value >= previous else value  # a decrease is a reset or a wrap
    return increase


def devices(attributes: dict[str, str]) -> tuple[list[str], list[str]]:
    """The GPUs (``gpu.uuid``) and NICs (``net.rdma.devices``) a span names; single values or JSON lists."""
    return _names(attributes.get("gpu.uuid", "")), _names(attributes.get("net.rdma.devices", ""))


def _names(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            return [str(v) for v in json.loads(text)]
        except ValueError:
            pass
    return [part.strip() for part in text.split(",") if part.strip()]


def context(store: Store, trace) -> list[dict]:
    """Error-class counters that rose on the GPUs and NICs a trace's spans name, while each span ran.

    What ``stagetrace trace`` shows beside the waterfall; largest increase per device and series.
    """
    spans = [s for s in trace.spans if any(devices(s.attributes))]
    if not spans:
        return []
    samples = Samples(store, sorted({s.resource.get("host.name", "") for s in spans}), trace.start_ns,
                      trace.start_ns + trace.duration_ns)  # fmt: skip
    found: dict[tuple, dict] = {}
    for span in spans:
        host = span.resource.get("host.name", "")
        for rise in samples.rises(host, *devices(span.attributes), span.start_ns, span.start_ns + span.duration_ns):
            key = (host, rise.device, rise.metric, tuple(sorted(rise.labels.items())))
            entry = found.setdefault(key, {"stage": span.stage, "host": host, "device": rise.device, "metric": rise.metric,
                                           "labels": rise.labels, "increase": 0.0})  # fmt: skip
            entry["increase"] = max(entry["increase"], rise.delta)
    return sorted(found.values(), key=lambda e: (-next(s.severity for s in SIGNALS if s.accepts(e["metric"], e["labels"])), e["device"]))
