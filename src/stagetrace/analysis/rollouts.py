"""Rollouts: a setting whose value changed on most hosts and stayed (an index rebuild, a template, weights, an image).

Per host, the values a setting took in a window are *regimes* when they do not interleave: each
value's first request comes after the previous value's last. A host *switched* from ``old`` to
``new`` when two consecutive regimes are ``old`` then ``new``, ``new`` held for at least
``MIN_PERSIST`` requests and is not followed by ``old`` again. A rollout is a switch that more than
half of the hosts carrying the setting as a state made (and at least half of all that carry it).

The fleet moved at ``fleet_ns``, the moment most hosts had switched; the wave began at the first
switch and is given as long again after ``fleet_ns`` (``until_ns``) for the slower half. A host
still serving the old value after that lags the fleet. Baselines respect the move: a request is
compared with requests on its own side of ``fleet_ns`` (``epoch``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone

from stagetrace.analysis.causes import RESOURCE
from stagetrace.store import Store

ROLLOUT_SQL = f"""
SELECT tupleElement(sk, 1) AS S, tupleElement(sk, 2) AS K, HostName,
       if(startsWith(K, '{RESOURCE}'), ResourceAttributes[substring(K, {len(RESOURCE) + 1})], Attributes[K]) AS Value,
       toUnixTimestamp64Nano(min(Start)), toUnixTimestamp64Nano(max(Start)), count()
FROM {{db:Identifier}}.stagetrace_stages
ARRAY JOIN arrayFilter(p -> tupleElement(p, 1) = Stage, arrayZip({{stages:Array(String)}}, {{keys:Array(String)}})) AS sk
WHERE Stage IN {{stages:Array(String)}}
  AND Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start < fromUnixTimestamp64Nano({{t1:Int64}})
GROUP BY S, K, HostName, Value
"""


MIN_PERSIST = 3  # requests a host serves with the new value before its switch counts: one odd request is no move


@dataclass
class Rollout:
    stage: str
    key: str  # contrast key: resource attributes carry the ``resource:`` prefix
    old: str
    new: str
    of_hosts: int  # hosts that carried the setting as a state (not a per-request value) in the window
    switched: dict[str, int]  # host → its first request with the new value, for the hosts in the wave
    fleet_ns: int
    until_ns: int
    lagging: dict[str, int | None] = field(default_factory=dict)  # host → when it caught up, None: never

    @property
    def name(self) -> str:
        return self.key.removeprefix(RESOURCE)

    @property
    def from_ns(self) -> int:
        return min(self.switched.values())

    @property
    def to_ns(self) -> int:
        return max(self.switched.values())

    def epoch(self, t_ns: int) -> bool:
        return t_ns >= self.fleet_ns

    def explains(self, value: str, baseline_value: str, t_ns: int) -> str | None:
        """``"expected"`` when the request's difference from its baseline is the rollout, ``"lagging"`` when its
        host still had the old value after the wave, else None."""
        if (value, baseline_value) == (self.new, self.old):
            return "expected"
        if (value, baseline_value) == (self.old, self.new):
            return "expected" if t_ns <= self.until_ns else "lagging"
        return None

    def describe(self) -> str:
        text = (f"{self.name} {self.old or '(unset)'} → {self.new or '(unset)'} rolled out {_clock(self.from_ns)}–"
                f"{_clock(self.to_ns)} to {len(self.switched)}/{self.of_hosts} hosts (expected change)")  # fmt: skip
        for host, caught_up in sorted(self.lagging.items()):
            text += f"; {host} " + (f"lagged until {_clock(caught_up)}" if caught_up else "still has the old value")
        return text

    def to_json(self) -> dict:
        return {"stage": self.stage, "name": self.name, "old": self.old, "new": self.new, "from_ns": self.from_ns,
                "to_ns": self.to_ns, "fleet_ns": self.fleet_ns, "hosts": len(self.switched), "of_hosts": self.of_hosts,
                "lagging": dict(sorted(self.lagging.items())), "summary": self.describe()}  # fmt: skip


def in_wave(stage: str | None, t_ns: int, found: list[Rollout]) -> bool:
    """Whether a request that diverged first at ``stage`` at ``t_ns`` falls in the wave of a rollout of that stage."""
    return any(r.stage == stage and r.from_ns <= t_ns <= r.until_ns for r in found)


VALUES_SQL = f"""
SELECT TraceId, if(startsWith({{key:String}}, '{RESOURCE}'), ResourceAttributes[substring({{key:String}}, {len(RESOURCE) + 1})],
                   Attributes[{{key:String}}])
FROM {{db:Identifier}}.stagetrace_stages
WHERE Stage = {{stage:String}} AND TraceId IN (SELECT arrayJoin({{traces:Array(String)}}))
  AND Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start <= fromUnixTimestamp64Nano({{t1:Int64}})
ORDER BY Start"""


def expected(store: Store, deviations: list, found: list[Rollout], margin_ns: int = 60_000_000_000) -> set[str]:
    """Trace IDs of the deviations (``population.Deviation``) a rollout's wave explains: in the wave, at the
    rollout's stage, differing from their baselines by the rollout's values."""
    out: set[str] = set()
    for r in found:
        wave = [d for d in deviations if r.stage == d.stage and r.from_ns <= d.start_ns <= r.until_ns]
        if not wave:
            continue
        traces = sorted({t for d in wave for t in (d.trace_id, d.baseline_trace_id)})
        values: dict[str, str] = {}
        for trace_id, value in store.client.query(VALUES_SQL, parameters={
                "db": store.database, "key": r.key, "stage": r.stage, "traces": traces,
                "t0": r.from_ns - margin_ns - (r.until_ns - r.from_ns), "t1": r.until_ns + margin_ns}).result_rows:  # fmt: skip
            values.setdefault(trace_id, value)  # a stage's first span
        out |= {d.trace_id for d in wave if r.explains(values.get(d.trace_id, ""), values.get(d.baseline_trace_id, ""),
                                                       d.start_ns) == "expected"}  # fmt: skip
    return out


def _clock(t_ns: int) -> str:
    return datetime.fromtimestamp(t_ns / 1e9, timezone.utc).strftime("%H:%M:%S UTC")


def detect(store: Store, candidates: list[tuple[str, str]], t0_ns: int, t1_ns: int) -> list[Rollout]:
    """The rollouts among ``(stage, contrast key)`` candidates in the window, oldest first."""
    candidates = sorted(set(candidates))
    if not candidates:
        return []
    rows = store.client.query(ROLLOUT_SQL, parameters={
        "db": store.database, "stages": [s for s, _ in candidates], "keys": [k for _, k in candidates],
        "t0": t0_ns, "t1": t1_ns}).result_rows  # fmt: skip
    values: dict[tuple[str, str], dict[str, list[tuple[int, int, int, str]]]] = defaultdict(lambda: defaultdict(list))
    for stage, key, host, value, first, last, count in rows:
        values[(stage, key)][host].append((int(first), int(last), int(count), value))
    found = []
    for (stage, key), hosts in values.items():
        found += _rollouts(stage, key, hosts)
    return sorted(found, key=lambda r: r.fleet_ns)


def _regimes(intervals: list[tuple[int, int, int, str]]) -> list[tuple[int, int, int, str]] | None:
    ordered = sorted(intervals)
    if any(b[0] <= a[1] for a, b in zip(ordered, ordered[1:])):
        return None  # the values interleave on this host: a per-request value, not a configuration
    return ordered


def _rollouts(stage: str, key: str, hosts: dict[str, list]) -> list[Rollout]:
    switches: dict[tuple[str, str], dict[str, tuple[int, int]]] = defaultdict(dict)  # (old, new) → host → (last, first)
    regimes_of = {host: _regimes(intervals) for host, intervals in hosts.items()}
    for host, regimes in regimes_of.items():
        for i, (before, after) in enumerate(zip(regimes or (), (regimes or ())[1:])):
            reverted = i + 2 < len(regimes) and regimes[i + 2][3] == before[3]
            if not reverted and after[2] >= MIN_PERSIST:
                switches[(before[3], after[3])][host] = (before[1], after[0])
    # Hosts where the value changes request by request (a batch size; a cache serving entries of both versions)
    # hold no state to roll out: most hosts means most of those that do, and at least half of all.
    stateful = [host for host, regimes in regimes_of.items() if regimes]
    found = []
    for (old, new), by_host in switches.items():
        if 2 * len(by_host) <= len(stateful) or 2 * len(by_host) < len(hosts):
            continue
        firsts = sorted(first for _, first in by_host.values())
        fleet = firsts[len(stateful) // 2]  # the switch that made it most hosts
        until = fleet + (fleet - firsts[0])
        wave = {h: first for h, (last, first) in by_host.items() if last <= until}
        lagging: dict[str, int | None] = {h: first for h, (last, first) in by_host.items() if last > until}
        for host, regimes in regimes_of.items():  # hosts that kept the old value after the fleet moved
            if host not in by_host and regimes and regimes[-1][3] == old and regimes[-1][1] > until:
                lagging[host] = None
        found.append(Rollout(stage, key, old, new, len(stateful), wave, fleet, until, lagging))
    return found
