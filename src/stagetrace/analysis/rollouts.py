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
from itertools import pairwise

from stagetrace.analysis.causes import RESOURCE
from stagetrace.store import Store

# per service: a rollout in one service is no rollout of another that uses the same attribute name
ROLLOUT_SQL = f"""
SELECT tupleElement(sk, 1) AS S, tupleElement(sk, 2) AS K, ServiceName, HostName,
       if(startsWith(K, '{RESOURCE}'), ResourceAttributes[substring(K, {len(RESOURCE) + 1})], Attributes[K]) AS Value,
       toUnixTimestamp64Nano(min(Start)), toUnixTimestamp64Nano(max(Start)), count()
FROM {{db:Identifier}}.stagetrace_stages
ARRAY JOIN arrayFilter(p -> tupleElement(p, 1) = Stage, arrayZip({{stages:Array(String)}}, {{keys:Array(String)}})) AS sk
WHERE Stage IN {{stages:Array(String)}} AND (empty({{traces:Array(String)}}) OR TraceId IN {{traces:Array(String)}})
  AND (__RANGES__) AND Start >= fromUnixTimestamp64Nano({{t0:Int64}}) AND Start < fromUnixTimestamp64Nano({{t1:Int64}})
GROUP BY S, K, ServiceName, HostName, Value
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
    service: str = ""  # the service whose hosts rolled it out: its requests' epochs, no other's

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
        # the service is named: a shared store holds other services' rollouts under the same attribute names
        hosts = f"{len(self.switched)}/{self.of_hosts} hosts" + (f" of {self.service}" if self.service else "")
        text = (
            f"{self.name} {self.old or '(unset)'} → {self.new or '(unset)'} rolled out {_clock(self.from_ns)}–"
            f"{_clock(self.to_ns)} to {hosts} (expected change)"
        )
        for host, caught_up in sorted(self.lagging.items()):
            text += f"; {host} " + (f"lagged until {_clock(caught_up)}" if caught_up else "still has the old value")
        return text

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "service": self.service,
            "name": self.name,
            "old": self.old,
            "new": self.new,
            "from_ns": self.from_ns,
            "to_ns": self.to_ns,
            "fleet_ns": self.fleet_ns,
            "hosts": len(self.switched),
            "of_hosts": self.of_hosts,
            "lagging": dict(sorted(self.lagging.items())),
            "summary": self.describe(),
        }


def value_of(span, key: str) -> str:
    """A span's value of a contrast key (``resource:`` for its resource's attributes)."""
    if key.startswith(RESOURCE):
        return span.resource.get(key.removeprefix(RESOURCE), "")
    return span.attributes.get(key, "")


def in_wave(stage: str | None, t_ns: int, found: list[Rollout], service: str | None = None) -> bool:
    """Whether a request that diverged first at ``stage`` (None: at any) and started at ``t_ns`` falls in the wave of
    a rollout of that stage in its ``service`` (None: any). A wave is dated by its stage spans, which start after their
    requests: a request that started up to ``AMONG_MARGIN_NS`` before it counts too."""
    return any(
        (stage is None or r.stage == stage)
        and (service is None or r.service == service)
        and r.from_ns - AMONG_MARGIN_NS <= t_ns <= r.until_ns
        for r in found
    )


def _clock(t_ns: int) -> str:
    return datetime.fromtimestamp(t_ns / 1e9, timezone.utc).strftime("%H:%M:%S UTC")


AMONG_MARGIN_NS = 5_000_000_000  # a request's stage spans start this close to it (a hint needs no more)


def _values(
    store: Store,
    candidates: list[tuple[str, str]],
    t0_ns: int,
    t1_ns: int,
    among: list[tuple[str, int]] = (),
    margin_ns: int = AMONG_MARGIN_NS,
) -> dict:
    """(stage, key, service) → host → [(first, last, requests, value)] of the candidates' values in the window, or
    only in the traces ``among`` (trace ID, start), read around their starts (the store is ordered by stage and time)."""
    ranges, params = [], {}
    for a, b in _merged(sorted((start - margin_ns, start + margin_ns) for _, start in among)):
        i = len(ranges)
        ranges.append(
            f"Start >= fromUnixTimestamp64Nano({{r{i}a:Int64}}) AND Start <= fromUnixTimestamp64Nano({{r{i}b:Int64}})"
        )
        params[f"r{i}a"], params[f"r{i}b"] = a, b
    sql = ROLLOUT_SQL.replace("__RANGES__", " OR ".join(f"({r})" for r in ranges) or "1")
    rows = store.client.query(
        sql,
        parameters={
            "db": store.database,
            "stages": [s for s, _ in candidates],
            "keys": [k for _, k in candidates],
            "t0": t0_ns,
            "t1": t1_ns,
            "traces": [t for t, _ in among],
            **params,
        },
    ).result_rows
    values: dict[tuple[str, str], dict[str, list[tuple[int, int, int, str]]]] = defaultdict(lambda: defaultdict(list))
    for stage, key, service, host, value, first, last, count in rows:
        values[(stage, key, service)][host].append((int(first), int(last), int(count), value))
    return values


def values_of(stage_spans, candidates: list[tuple[str, str]]) -> dict:
    """Like ``_values``, from spans already read: ``stage_spans`` yields (stage, span)."""
    wanted: dict[str, list[str]] = defaultdict(list)
    for stage, key in candidates:
        wanted[stage].append(key)
    found: dict = defaultdict(lambda: defaultdict(dict))
    for stage, span in stage_spans:
        for key in wanted.get(stage, ()):
            value, host = value_of(span, key), span.resource.get("host.name", "")
            first, last, count = found[(stage, key, span.service)][host].get(value, (span.start_ns, span.start_ns, 0))
            found[(stage, key, span.service)][host][value] = (
                min(first, span.start_ns),
                max(last, span.start_ns),
                count + 1,
            )
    return {
        key: {host: [(*v, value) for value, v in values.items()] for host, values in hosts.items()}
        for key, hosts in found.items()
    }


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def detect(
    store: Store, candidates: list[tuple[str, str]], t0_ns: int, t1_ns: int, among: list[tuple[str, int]] | None = None
) -> list[Rollout]:
    """The rollouts among ``(stage, contrast key)`` candidates in the window, oldest first.

    ``among``: (trace ID, start) of a few requests (a request's nearest peers) to look at first; only the
    candidates whose values look like a rollout there (``suspects``) are then looked for in the whole window.
    """
    candidates = sorted(set(candidates))
    if candidates and among is not None:
        candidates = suspects(_values(store, candidates, t0_ns, t1_ns, among))
    if not candidates:
        return []
    values = _values(store, candidates, t0_ns, t1_ns)
    found = []
    for (stage, key, service), hosts in values.items():
        found += _rollouts(stage, key, hosts, service)
    return sorted(found, key=lambda r: r.fleet_ns)


def suspects(values: dict) -> list[tuple[str, str]]:
    """The (stage, key)s whose values (as ``_values`` gives them) look like a rollout among a few requests: two
    hosts (or the only one) of a service switched cleanly from one value to the same other. A value that one host
    alone moved to (a fault, a restart) is no rollout, and no full detection is run for it."""
    out = set()
    for (stage, key, _), hosts in values.items():
        switched: dict[tuple[str, str], int] = defaultdict(int)  # (old, new) → hosts seen switching
        for intervals in hosts.values():
            for before, after in pairwise(_regimes(intervals) or ()):
                switched[(before[3], after[3])] += 1
        if any(n >= 2 or len(hosts) == 1 for n in switched.values()):
            out.add((stage, key))
    return sorted(out)


def _regimes(intervals: list[tuple[int, int, int, str]]) -> list[tuple[int, int, int, str]] | None:
    ordered = sorted(intervals)
    if any(b[0] <= a[1] for a, b in zip(ordered, ordered[1:])):
        return None  # the values interleave on this host: a per-request value, not a configuration
    return ordered


def _rollouts(stage: str, key: str, hosts: dict[str, list], service: str = "") -> list[Rollout]:
    switches: dict[tuple[str, str], dict[str, tuple[int, int]]] = defaultdict(dict)  # (old, new) → host → (last, first)
    regimes_of = {host: _regimes(intervals) for host, intervals in hosts.items()}
    for host, regimes in regimes_of.items():
        for i, (before, after) in enumerate(pairwise(regimes or ())):
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
        found.append(Rollout(stage, key, old, new, len(stateful), wave, fleet, until, lagging, service))
    return found
