"""Hardware evidence: error-class counters that rose on a stage's GPUs and NICs in its window.

Signals are described as data (metric, which device label joins it to a span, label filter,
severity, rule), and what is read is derived from them, in two queries over the hosts and time range:
first each host's sample times and metric names in the signals' metric families (``gpu_``, ``rdma_``,
``nic_``, …: names and times only), then the samples of exactly the names some signal accepts (a
pattern is matched against the names found, by the same ``Signal.names`` as in memory), label filters
applied in the store, so only the series some signal accepts are read. Severity orders causes that rose together: an ack timeout ranks above the retransmits it
causes, an XID above the ECC count behind it. A stage's window runs from the second-to-last scrape
of its host at or before its start (one scrape interval of margin, so an error just before the stage,
whose damage lasts, still counts) to the first scrape at or after its end. A host's scrapes are the
times of its samples in the signals' metric families (a scrape writes all of them at once). Increases are reset-safe: a decrease is a reset or a 32-bit
wrap, and the new value is the increase since. A series that first appears inside the window, after the
host's first scrape, rose from zero (an ``gpu_xid_errors_total{xid}`` series is born at its first event).

Rules. A counter signal is active when it rose at all in the window; a gauge signal
(``gauge_above``/``gauge_below``) while its value is past the bound. A *relative* signal
(``ratio_above``) is active when the series is well above its own typical level, which is learnt from
the same series over the lookaround (``LOOKAROUND_NS`` either side of the window), outside the window:

- a counter: its increase in the window is more than ``ratio_above`` × its typical increase over a
  window as long, the typical increase being the median per-second increase of the scrape intervals
  outside the window times the window's length; and its per-second rate in the window is at least
  ``floor``. With fewer than ``MIN_TYPICAL`` intervals outside the window the floor alone decides.
  PFC pause frames are normal at a low rate under load: a pause *storm* is a rate ten times the
  series' usual one and at least 1000 frames/s (sustained pausing, which a NIC refreshes thousands of
  times a second; a judgement, not a documented number). The paused time
  (``nic_pfc_pause_duration_seconds_total``, seconds per second = the fraction of time paused) the
  same way: ten times usual and at least 10 % of the window paused.
- a gauge: its highest value in the window is more than ``ratio_above`` × the median of its samples
  outside the window (and at least ``floor`` if given); with fewer than ``MIN_TYPICAL`` such samples it
  has no typical value and is not active. NCCL collective time: three times the series' usual mean
  time. Each series is its own reference (one communicator, collective, message-size bucket and
  algorithm), so a large all-reduce is never compared with a small one.

Joining. GPU series join spans' ``gpu.uuid`` on their ``uuid`` label (``nccl_*`` too); RDMA series
join ``net.rdma.devices`` on ``device``. ``nic_*`` series (ethtool) are per netdev: the netdev is mapped
to its RDMA device through the RDMA series of the same host that carry both ``device`` and ``netdev``
(``rdma_port_info``), so a span naming ``mlx5_0`` gets the PFC counters of ``mlx5_0``'s ``eth0``; with no
mapping known, the netdev's own name is matched against the span's devices. A span that moves data over the
fabric and names no NIC (SGLang's KV transfer, ``conventions.moves_over_fabric``) gets every NIC read on its host
(``weighed``).
"""

from __future__ import annotations

import bisect
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from stagetrace import conventions
from stagetrace.store import Store

GPU, NIC = "gpu", "nic"
NETDEV = "netdev"
DEVICE_LABELS = {GPU: "uuid", NIC: "device"}  # the label naming the device, unless a signal says otherwise
NETDEV_MAP_METRIC = "rdma_port_info"  # RDMA ports: labels device, port, netdev (read when a signal joins on netdev)


@dataclass(frozen=True)
class Signal:
    metric: str  # a metric name, or a regular expression (full match) when ``pattern``
    device: str  # GPU series join spans' gpu.uuid, NIC series their net.rdma.devices
    severity: float
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # label → accepted values
    gauge_above: float | None = None  # a gauge signal: active while its value is above this
    gauge_below: float | None = None
    pattern: bool = False
    # Scrape intervals of margin before the stage: an uncorrectable memory error corrupts until the GPU is reset.
    lookback: int = 1
    gauge: bool = False  # the series is a gauge (implied by gauge_above/gauge_below)
    ratio_above: float | None = None  # relative rule: active when this many times the series' typical level
    floor: float | None = None  # and at least this (a counter: per second over the window; a gauge: its value)
    label: str = ""  # the label naming the device; "" is the kind's (uuid, device); "netdev" maps through RDMA ports

    @property
    def is_gauge(self) -> bool:
        return self.gauge or self.gauge_above is not None or self.gauge_below is not None

    @property
    def device_label(self) -> str:
        return self.label or DEVICE_LABELS[self.device]

    def names(self, name: str) -> bool:
        """Whether this signal reads the metric ``name`` (some of its series, when ``where`` filters labels)."""
        return bool(re.fullmatch(self.metric, name)) if self.pattern else name == self.metric

    def accepts(self, name: str, labels: dict[str, str]) -> bool:
        return self.names(name) and all(labels.get(k) in values for k, values in self.where)


PFC_SEVERITY = 0.65
SIGNALS = (
    Signal("gpu_xid_errors_total", GPU, 1.0, lookback=3),
    Signal("gpu_ecc_errors_total", GPU, 0.95, where=(("type", ("uncorrected",)),), lookback=3),
    Signal("gpu_up", GPU, 0.95, gauge_below=1),
    Signal("rdma_link_downed_total", NIC, 0.95),
    Signal("rdma_local_ack_timeout_err_total", NIC, 0.9),
    Signal("rdma_(out_of_sequence|packet_seq_err|implied_nak_seq_err)_total", NIC, 0.85, pattern=True),
    # the port stalled past the critical timeout and stopped sending pause frames: drops may follow
    Signal("nic_pause_storm_events_total", NIC, 0.85, where=(("level", ("error",)),), label=NETDEV),
    Signal(
        "rdma_(roce_adp_retrans|roce_adp_retrans_to|rnr_nak_retry_err|req_transport_retries_exceeded)_total",
        NIC,
        0.8,
        pattern=True,
    ),
    Signal(
        "rdma_(symbol_errors|port_receive_errors|link_error_recovery|local_link_integrity_errors)_total",
        NIC,
        0.75,
        pattern=True,
    ),
    # packets the port dropped for lack of buffers: loss on what should be a lossless fabric
    Signal("nic_discards_total", NIC, 0.7, label=NETDEV),
    Signal("rdma_.*err.*_total", NIC, 0.7, pattern=True),  # any other error-class hw counter
    # the port stalled past the minor watermark (informative: pause transmission still on)
    Signal("nic_pause_storm_events_total", NIC, PFC_SEVERITY, where=(("level", ("warning",)),), label=NETDEV),
    Signal("nic_pfc_pause_frames_total", NIC, PFC_SEVERITY, ratio_above=10, floor=1000, label=NETDEV),
    Signal("nic_pfc_pause_duration_seconds_total", NIC, PFC_SEVERITY, ratio_above=10, floor=0.1, label=NETDEV),
    Signal(
        "gpu_clock_event_active",
        GPU,
        0.6,
        gauge_above=0,
        where=(("reason", ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")),),
    ),
    Signal("nccl_collective_time_seconds", GPU, 0.55, gauge=True, ratio_above=3),  # collectives far slower than usual
    Signal("mps_clients", GPU, 0.5, gauge_above=1),  # co-tenancy: another MPS client on the same GPU
    # the netdev's receive queues had no software buffers (the host's Ethernet path, not RoCE's)
    Signal("nic_out_of_buffer_total", NIC, 0.5, label=NETDEV),
)

LOOKAROUND_NS = 10 * 60 * 1_000_000_000  # samples fetched around the windows: enough for a few scrape intervals
MIN_TYPICAL = 3  # samples (gauges) or scrape intervals (counters) outside the window that make a typical level
TABLES = {False: "otel_metrics_sum", True: "otel_metrics_gauge"}

_RANGE = """TimeUnix >= fromUnixTimestamp64Nano({t0:Int64}) AND TimeUnix <= fromUnixTimestamp64Nano({t1:Int64})
      AND ResourceAttributes['host.name'] IN {hosts:Array(String)}"""

# Step 1: per host, its scrape times and the metric names it has in the signals' families (times and names only).
_PRESENT = f"""
    SELECT ResourceAttributes['host.name'] AS Host, {conventions.time_ns_sql("TimeUnix")} AS T, MetricName, {{gauge}} AS Gauge
    FROM {{{{db:Identifier}}}}.{{table}}
    WHERE {{range}}{{families}}"""

# Step 2: the samples of the names some signal accepts, label filters applied in the store.
_SELECT = f"""
    SELECT ResourceAttributes['host.name'] AS Host, MetricName, Attributes, {conventions.time_ns_sql("TimeUnix")} AS T, Value
    FROM {{{{db:Identifier}}}}.{{table}}
    WHERE {{range}}
      AND MetricName IN {{{{{{key}}_names:Array(String)}}}}{{filters}}"""


def families(signals: Sequence[Signal]) -> list[str]:
    """The metric-name prefixes (``gpu_``, ``rdma_``) of the signals' collectors: their samples mark scrapes."""
    found = set()
    for signal in signals:
        match = re.match(r"[A-Za-z0-9]+_", signal.metric)
        found.add(match.group(0) if match else "")  # a pattern without a literal prefix: every metric
    return sorted(found)


def present_query(signals: Sequence[Signal]) -> tuple[str, dict]:
    """Per host: its scrape times, and the names in the signals' families of each table (sum, gauge).

    Only times and names are read (a few bytes a sample); ``NETDEV_MAP_METRIC`` too when a signal joins on netdev.
    """
    params: dict = {}
    prefixes = families(signals) + ([NETDEV_MAP_METRIC] if any(s.device_label == NETDEV for s in signals) else [])
    where = ""
    if "" not in prefixes:  # a filter the primary key (ServiceName, MetricName, ...) prunes on
        params.update({f"family{i}": prefix for i, prefix in enumerate(prefixes)})
        tests = " OR ".join(f"startsWith(MetricName, {{family{i}:String}})" for i in range(len(prefixes)))
        where = f"\n      AND ({tests})"
    selects = "\n    UNION ALL".join(
        _PRESENT.format(gauge=int(gauge), table=table, range=_RANGE, families=where) for gauge, table in TABLES.items()
    )
    sql = (
        f"SELECT Host, arraySort(groupUniqArray(T)), groupUniqArrayIf(MetricName, Gauge = 0),"
        f" groupUniqArrayIf(MetricName, Gauge = 1)\nFROM ({selects}\n)\nGROUP BY Host\n"
    )
    return sql, params


def metrics_query(signals: Sequence[Signal], present: dict[bool, set[str]]) -> tuple[str, dict]:
    """The query for the samples ``signals`` accept among the ``present`` names (gauge? -> names), and its parameters.

    Each table's accepted names go into one ``MetricName IN`` (what the primary key prunes on); a signal with a
    label filter adds its names and filter as one clause, so the series it would refuse are not read either.
    Plus ``NETDEV_MAP_METRIC`` (a gauge) when a signal joins on netdev. ``""`` when nothing is to be read.
    """
    params: dict = {}
    selects = []
    joins_netdev = any(s.device_label == NETDEV for s in signals)
    for gauge, table in TABLES.items():
        key = table.removeprefix("otel_metrics_")
        mine = [s for s in signals if s.is_gauge == gauge]
        names = {name for name in present.get(gauge, ()) if any(s.names(name) for s in mine)}
        mapping = gauge and joins_netdev and NETDEV_MAP_METRIC in present.get(gauge, ())
        if not names and not mapping:
            continue
        params[f"{key}_names"] = sorted(names | ({NETDEV_MAP_METRIC} if mapping else set()))
        filters = ""
        if any(s.where for s in mine if any(s.names(n) for n in names)):
            # a name is read whole when a signal without a label filter accepts it; else only as the filters say
            clauses, whole = [], sorted(n for n in names if any(s.names(n) and not s.where for s in mine))
            if mapping:
                whole.append(NETDEV_MAP_METRIC)
            params[f"{key}_whole"] = whole
            clauses.append(f"MetricName IN {{{key}_whole:Array(String)}}")
            for i, signal in enumerate(s for s in mine if s.where):
                these = sorted(n for n in names if signal.names(n))
                if not these:
                    continue
                params[f"{key}_{i}_names"] = these
                parts = [f"MetricName IN {{{key}_{i}_names:Array(String)}}"]
                for j, (label, values) in enumerate(signal.where):
                    params[f"{key}_{i}_label{j}"], params[f"{key}_{i}_values{j}"] = label, list(values)
                    parts.append(f"Attributes[{{{key}_{i}_label{j}:String}}] IN {{{key}_{i}_values{j}:Array(String)}}")
                clauses.append("(" + " AND ".join(parts) + ")")
            filters = "\n      AND (" + " OR ".join(clauses) + ")"
        selects.append(_SELECT.format(table=table, range=_RANGE, key=key, filters=filters))
    if not selects:
        return "", params
    union = "\n    UNION ALL".join(selects)
    return f"SELECT Host, MetricName, Attributes, T, Value FROM ({union}\n)\nORDER BY T\n", params


@dataclass
class Series:
    signal: Signal
    device: str  # the value of the signal's device label (a netdev for nic_* series)
    labels: dict[str, str]
    times: list[int]
    values: list[float]


@dataclass(frozen=True)
class Timing:
    """Where a rise lies against the stage it is blamed on: the one account of time that the verdict's sentence,
    the incident report's chart and the JSON all read, so that they cannot disagree.

    ``window_ns`` is the window the detector weighed (scrapes, as ``Samples.window`` makes it), ``stage_ns`` the
    span's start and end, ``rise_ns`` when the change happened as far as the scrapes can tell: for a counter, from
    the scrape before the first sample that showed an increase to the last sample that did (it rose at some time
    in between); for a gauge, its first and last sample past the bound.
    """

    window_ns: tuple[int, int]
    stage_ns: tuple[int, int]
    rise_ns: tuple[int, int]

    def words(self, stage: str) -> str:
        """Where in the window the change happened, against ``stage``: "in the 8.8 s before decode started",
        "while decode ran", "in the 3.7 s after decode ended", or, when the scrapes straddle an edge of the stage,
        "between 1.2 s before decode started and 3.7 s after it ended". Each number is rounded outwards, so
        the words hold for every time the scrapes allow."""
        (start, end), (first, last) = self.stage_ns, self.rise_ns
        if last <= start:
            return f"in the {seconds(start - first)} before {stage} started"
        if first >= start and last <= end:
            return f"while {stage} ran"
        if first >= end:
            return f"in the {seconds(last - end)} after {stage} ended"
        return f"between {_edge(first, start, end, stage)} and {_edge(last, start, end, 'it')}"

    def to_json(self) -> dict:
        return {"window_ns": list(self.window_ns), "stage_ns": list(self.stage_ns), "rise_ns": list(self.rise_ns)}

    @classmethod
    def of(cls, evidence: dict) -> Timing | None:
        """The timing a cause's evidence (``to_json``'s keys) carries; None for one without it."""
        try:
            return cls(*(tuple(int(t) for t in evidence[key]) for key in ("window_ns", "stage_ns", "rise_ns")))
        except (KeyError, TypeError, ValueError):
            return None


def seconds(ns: int) -> str:
    """A duration as the sentence says it, rounded up (a bound: "in the 8.8 s before" must hold): whole seconds
    from 10 s, tenths below, milliseconds under one second."""
    if ns >= 10 * 10**9:
        return f"{math.ceil(ns / 1e9)} s"
    if ns >= 10**9:
        return f"{math.ceil(ns / 1e8) / 10:g} s"
    return f"{math.ceil(ns / 1e6)} ms"


def _edge(t: int, start: int, end: int, stage: str) -> str:
    if t < start:
        return f"{seconds(start - t)} before {stage} started"
    if t <= end:
        return f"{seconds(t - start)} after {stage} started"
    return f"{seconds(t - end)} after {stage} ended"


@dataclass
class Rise:
    """A signal that rose (or was active) on a device in a window."""

    signal: Signal
    metric: str
    device: str  # as the span names it: a GPU uuid, an RDMA device
    labels: dict[str, str]
    delta: float  # counter increase, or the gauge's extreme value while active
    typical: float | None = None  # relative signals: the series' usual increase over such a window, or usual value
    timing: Timing | None = None  # the window weighed, the stage, and when in it the change happened


class Samples:
    """Error-class series of some hosts over a time range, fetched once and queried per window.

    ``signals`` defaults to ``SIGNALS``; only the series they accept are read.
    """

    def __init__(self, store: Store, hosts: list[str], t0_ns: int, t1_ns: int, signals: Sequence[Signal] | None = None):
        signals = tuple(SIGNALS if signals is None else signals)
        params = {
            "db": store.database,
            "hosts": sorted(set(hosts)),
            "t0": t0_ns - LOOKAROUND_NS,
            "t1": t1_ns + LOOKAROUND_NS,
        }
        self._scrape_times: dict[str, list[int]] = {}
        self._by_device: dict[tuple[str, str], list[tuple[str, Series]]] = defaultdict(list)
        self._nics: dict[str, set[str]] = defaultdict(set)  # host -> the NICs (as spans name them) read there
        if not signals:
            return
        sql, extra = present_query(signals)
        present: dict[bool, set[str]] = {False: set(), True: set()}
        for host, times, sums, gauges in store.client.query(sql, parameters={**params, **extra}).result_rows:
            if times:
                self._scrape_times[host] = list(times)
            present[False].update(sums)
            present[True].update(gauges)
        sql, accepted = metrics_query(signals, present)
        if not sql:
            return
        grouped: dict[tuple, Series] = {}
        netdevs: dict[tuple[str, str], set[str]] = defaultdict(set)  # (host, netdev) -> its RDMA devices
        for host, name, labels, t, value in store.client.query(sql, parameters={**params, **accepted}).result_rows:
            if name.startswith("rdma_") and labels.get("netdev") and labels.get("device"):
                netdevs[(host, labels["netdev"])].add(labels["device"])
            signal = next((s for s in signals if s.accepts(name, labels)), None)
            if signal is None:
                continue
            device = labels.get(signal.device_label, "")
            key = (host, name, tuple(sorted(labels.items())))
            series = grouped.setdefault(key, Series(signal, device, labels, [], []))
            series.times.append(t)
            series.values.append(value)
        for (host, name, _), series in grouped.items():
            if series.signal.device_label == NETDEV:
                names = netdevs.get((host, series.device)) or {series.device}
            else:
                names = {series.device}
            for device in sorted(names):
                self._by_device[(host, device)].append((name, series))
                if series.signal.device == NIC:
                    self._nics[host].add(device)

    def series(self, host: str, device: str) -> list[tuple[str, Series]]:
        """The (metric name, series) pairs read for ``device`` (as spans name it) on ``host``."""
        return list(self._by_device.get((host, device), ()))

    def nics(self, host: str) -> list[str]:
        """Every NIC of ``host`` that some signal's series were read for, as spans name them (RDMA devices)."""
        return sorted(self._nics.get(host, ()))

    def window(self, host: str, start_ns: int, end_ns: int, lookback: int = 1) -> tuple[int, int] | None:
        """From ``lookback`` scrapes before the last one at or before ``start`` to the first at or after ``end``."""
        scrapes = self._scrape_times.get(host)
        if not scrapes:
            return None
        first = max(bisect.bisect_right(scrapes, start_ns) - 1 - lookback, 0)
        last = min(bisect.bisect_left(scrapes, end_ns), len(scrapes) - 1)
        return scrapes[first], scrapes[last]

    def rises(self, host: str, gpus: list[str], nics: list[str], start_ns: int, end_ns: int) -> list[Rise]:
        """What rose on the devices while a span ran from ``start_ns`` to ``end_ns``, each with its ``Timing``."""
        scrapes = self._scrape_times.get(host)
        if not scrapes:
            return []
        out = []
        for device in dict.fromkeys([*gpus, *nics]):
            for name, series in self._by_device.get((host, device), ()):
                window = self.window(host, start_ns, end_ns, series.signal.lookback)
                delta, typical, when = _rise(series, *window, scrapes)
                if delta > 0 and when is not None:
                    out.append(
                        Rise(
                            series.signal,
                            name,
                            device,
                            series.labels,
                            delta,
                            typical,
                            Timing(window, (start_ns, end_ns), when),
                        )
                    )
        return out


def _rise(series: Series, w0: int, w1: int, scrapes: list[int]) -> tuple[float, float | None, tuple[int, int] | None]:
    """(what the signal shows in the window, 0 when it is not active; the typical level for a relative signal; when
    in the window it changed, as ``Timing.rise_ns``). ``scrapes``: the host's scrape times."""
    lo = bisect.bisect_left(series.times, w0)
    hi = bisect.bisect_right(series.times, w1)
    values = series.values[lo:hi]
    if not values:
        return 0.0, None, None
    signal = series.signal
    if signal.ratio_above is not None:
        return _relative(series, lo, hi, w0, w1, scrapes)
    if signal.gauge_above is not None:
        active = [i for i in range(lo, hi) if series.values[i] > signal.gauge_above]
        return max((series.values[i] for i in active), default=0.0), None, _span(series, active)
    if signal.gauge_below is not None:
        active = [i for i in range(lo, hi) if series.values[i] < signal.gauge_below]
        return (1.0 if active else 0.0), None, _span(series, active)
    increase, when = _increase(series, lo, hi, w0, scrapes)
    return increase, None, when


def _span(series: Series, samples: list[int]) -> tuple[int, int] | None:
    """A gauge's first and last sample (indices) past its bound: when it was seen so."""
    return (series.times[samples[0]], series.times[samples[-1]]) if samples else None


def _increase(series: Series, lo: int, hi: int, w0: int, scrapes: list[int]) -> tuple[float, tuple[int, int] | None]:
    """The counter's increase over samples ``lo:hi``, and from the scrape before its first step to its last step."""
    times, values = series.times, series.values
    born_after = scrapes[0]  # a series whose first sample is later was born then: it rose from zero
    steps = []  # (the scrape before, the sample that showed it) of each step up
    increase = 0.0
    if lo == 0 and times[0] > max(w0, born_after) and values[0] > 0:
        increase = values[0]
        steps.append((scrapes[max(bisect.bisect_left(scrapes, times[0]) - 1, 0)], times[0]))
    for i in range(lo + 1, hi):
        step = values[i] - values[i - 1] if values[i] >= values[i - 1] else values[i]  # a decrease: reset or wrap
        if step > 0:
            increase += step
            steps.append((times[i - 1], times[i]))
    return increase, ((min(a for a, _ in steps), max(b for _, b in steps)) if steps else None)


def _relative(
    series: Series, lo: int, hi: int, w0: int, w1: int, scrapes: list[int]
) -> tuple[float, float | None, tuple[int, int] | None]:
    signal = series.signal
    times, values = series.times, series.values
    around_lo = bisect.bisect_left(times, w0 - LOOKAROUND_NS)
    around_hi = bisect.bisect_right(times, w1 + LOOKAROUND_NS)
    if signal.is_gauge:
        outside = values[around_lo:lo] + values[hi:around_hi]
        peak = max(values[lo:hi])
        if len(outside) < MIN_TYPICAL:
            return 0.0, None, None
        typical = statistics.median(outside)
        active = peak > signal.ratio_above * typical and (signal.floor is None or peak >= signal.floor)
        above = [i for i in range(lo, hi) if values[i] > signal.ratio_above * typical]
        return (peak if active else 0.0), typical, _span(series, above)
    seconds_in = (w1 - w0) / 1e9
    increase, when = _increase(series, lo, hi, w0, scrapes)
    if seconds_in <= 0 or increase <= 0:
        return 0.0, None, None
    rates = []  # per second, over the scrape intervals of the lookaround that lie outside the window
    for i in range(around_lo, around_hi - 1):
        t, t_next = times[i], times[i + 1]
        if t_next <= w0 or t >= w1:
            step = values[i + 1] - values[i] if values[i + 1] >= values[i] else values[i + 1]
            rates.append(step / ((t_next - t) / 1e9))
    floor_met = signal.floor is None or increase / seconds_in >= signal.floor
    if len(rates) < MIN_TYPICAL:
        return (increase if signal.floor is not None and floor_met else 0.0), None, when
    typical = statistics.median(rates) * seconds_in
    return (increase if floor_met and increase > signal.ratio_above * typical else 0.0), typical, when


def devices(attributes: dict[str, str]) -> tuple[list[str], list[str]]:
    """The GPUs (``gpu.uuid``) and NICs (``net.rdma.devices``) a span names; single values or JSON lists."""
    return _names(attributes.get("gpu.uuid", "")), _names(attributes.get("net.rdma.devices", ""))


def weighed(samples: Samples, span) -> tuple[list[str], list[str]]:
    """The GPUs and NICs whose signals count for ``span``: those it names; for a span that moves data over the
    fabric and names no NIC (``conventions.moves_over_fabric``: SGLang's KV transfer), every NIC read on its host."""
    gpus, nics = devices(span.attributes)
    if not nics and conventions.moves_over_fabric(span.name):
        nics = samples.nics(span.resource.get("host.name", ""))
    return gpus, nics


def _names(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        try:
            return [str(v) for v in json.loads(text)]
        except ValueError:
            pass
    return [part.strip() for part in text.split(",") if part.strip()]


def context(store: Store, trace) -> list[dict]:
    """Error-class counters that rose on the GPUs and NICs a trace's spans name, in each span's window.

    What ``stagetrace trace`` shows beside the waterfall; largest increase per device and series (with
    the series' typical level, ``typical``, for a relative signal), and where in the window it rose (``when``:
    ``Timing.words``, as ``explain`` says it, with the timing's times).
    """
    spans = [s for s in trace.spans if any(devices(s.attributes)) or conventions.moves_over_fabric(s.name)]
    if not spans:
        return []
    samples = Samples(
        store,
        sorted({s.resource.get("host.name", "") for s in spans}),
        trace.start_ns,
        trace.start_ns + trace.duration_ns,
    )
    found: dict[tuple, dict] = {}
    severity: dict[tuple, float] = {}
    for span in spans:
        host = span.resource.get("host.name", "")
        for rise in samples.rises(host, *weighed(samples, span), span.start_ns, span.start_ns + span.duration_ns):
            key = (host, rise.device, rise.metric, tuple(sorted(rise.labels.items())))
            entry = found.setdefault(
                key,
                {
                    "stage": span.stage,
                    "host": host,
                    "device": rise.device,
                    "metric": rise.metric,
                    "labels": rise.labels,
                    "increase": 0.0,
                },
            )
            severity[key] = rise.signal.severity
            if rise.delta > entry["increase"]:
                entry["increase"] = rise.delta
                if rise.typical is not None:
                    entry["typical"] = rise.typical
                if rise.timing is not None:  # the same words as explain's sentence
                    entry["when"] = rise.timing.words(span.stage or span.name)
                    entry |= rise.timing.to_json()
    return [found[k] for k in sorted(found, key=lambda k: (-severity[k], found[k]["device"]))]
