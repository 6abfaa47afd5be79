"""Attribution in a shared store (issue 51): answers unchanged by neighbours, and concurrent configuration faults.

Both measure accuracy, not time, on fleets recorded with the tests' simulated fleet (``tests/fleet.py``), each drawn
from a seed so that the figures are not those of one fleet the tests were written against:

- ``neighbours``: a first service (a host on a stale index, a host whose all-reduce algorithm changes, a template
  rolled out to every host) is analysed alone; then three neighbours are written into its store over the same hours
  (a shadow deployment of another model on the same prompts, a service with the same setting names and other values
  and a rollout of its own, a canary of the same model on the same host names with a fault and a rollout of its
  own). The figure: the share of the first service's answers (``explain``'s stage, top cause and baseline for a
  third of its requests; ``divergences``' entries for all) identical to its answers alone. Aim: 98%.
- ``concurrent_faults``: a heterogeneous fleet where five or six hosts deviate at decode at once, each for its own
  configuration difference under a name the configuration detector does not write, beside healthy hosts and a
  harmlessly different one. The figure: the share of deviating requests whose top cause is their host's own setting,
  in ``explain`` (half of them) and ``divergences`` (all). Aim: 95%.

Run from the repository root (the fleet helper is read from ``tests/``). To set today's code beside it, run the same
module with an older tree first on ``PYTHONPATH`` (``git archive COMMIT | tar -x -C DIR``; then
``PYTHONPATH=DIR/src:DIR python -m benchmarks.neighbours``): it uses only what both versions report.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import tempfile
from pathlib import Path

from benchmarks import Figure, benchmark
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store

_FLEET = Path(__file__).resolve().parents[1] / "tests" / "fleet.py"
SINCE_NS = 24 * 3600 * 10**9


def _fleet_module():
    name = "stagetrace_tests_fleet"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _FLEET)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _top(causes: list[dict]) -> tuple | None:
    top = next((c for c in causes if c and not c["weak"]), None)
    return (top["kind"], top["stage"], top["name"], top["value"], top["baseline_value"]) if top else None


# -- answers unchanged by neighbours
def _first_service(fleet, fl, rng: random.Random, minutes: int) -> list[str]:
    hosts = [f"h{i}" for i in range(1, rng.randint(4, 6) + 1)]
    stale, other = rng.sample(hosts, 2)
    rollout_at, algorithm_at = rng.randint(minutes // 3, 2 * minutes // 3), rng.randint(minutes // 4, 3 * minutes // 4)
    every = rng.choice((10, 12, 15))
    for i, t, host in fleet.timeline(fl.at(0), fl.at(minutes), every * fleet.SECOND, hosts):
        settings, differs = {}, {}
        if host == stale:
            settings["retrieval.index.version"], differs["retrieval"] = "v40", "v40"
        if t >= fl.at(rollout_at + hosts.index(host)):
            settings["context.template.version"], differs["context_assembly"] = "t4", "t4"
        if host == other and t >= fl.at(algorithm_at):
            settings["allreduce.algorithm"], differs["allreduce"] = "tree", "tree"
        fl.request(f"rag-{i:04d}", t, host, prompt=rng.randrange(4), settings=settings, differs=differs)
    fl.flush()
    return hosts


def _neighbours(fleet, store, t0: int, hosts: list[str], rng: random.Random, minutes: int) -> None:
    shadow = fleet.Fleet(store, t0, service="rag-shadow", model="acme-8b")
    every = rng.choice((5, 6, 8)) * fleet.SECOND
    for i, t, host in fleet.timeline(shadow.at(0), shadow.at(minutes), every, ["s1", "s2"]):
        shadow.request(f"shadow-{i:04d}", t, host, prompt=rng.randrange(4), differs={"decode": "8b"})
    batch = fleet.Fleet(store, t0, service="batch")
    moved = rng.randint(minutes // 4, 2 * minutes // 3)
    others = ["b1", "b2", "b3"]
    for i, t, host in fleet.timeline(batch.at(0), batch.at(minutes), 20 * fleet.SECOND, others):
        index = "v8" if t >= batch.at(moved + others.index(host)) else "v7"
        batch.request(
            f"batch-{i:04d}",
            t,
            host,
            prompt=rng.randrange(4),
            settings={"retrieval.index.version": index, "allreduce.algorithm": "tree"},
            differs={"retrieval": index, "allreduce": "tree"},
        )
    canary = fleet.Fleet(store, t0, service="rag-canary")
    faulty, template_at = rng.sample(hosts, 2), rng.randint(minutes // 8, minutes // 2)
    for i, t, host in fleet.timeline(canary.at(0), canary.at(minutes), 20 * fleet.SECOND, hosts):
        settings, differs = {}, {}
        if t >= canary.at(template_at + hosts.index(host)):
            settings["context.template.version"], differs["context_assembly"] = "t5", "t5"
        if host in faulty:
            settings["decode.kv_cache_dtype"], differs["decode"] = "fp8", "fp8"
        canary.request(f"canary-{i:04d}", t, host, prompt=rng.randrange(4), settings=settings, differs=differs)
    for fl in (shadow, batch, canary):
        fl.flush()


def _answers(store, requests: list[str]) -> tuple[dict, dict]:
    explainer = Explainer(store)
    explained = {}
    for rid in requests:
        r = explainer.explain(rid).to_json()
        explained[rid] = (
            r["diverged"],
            r["first_divergent_stage"],
            (r["baseline"] or {}).get("request_id"),
            _top(r["causes"]),
        )
    found = divergences.find(store, SINCE_NS, limit=None)
    entries = {
        d["request_id"]: (d["first_divergent_stage"], d["baseline_request_id"], _top([d["top_cause"]]))
        for g in found["groups"]
        for d in g["deviating"]
        if d["service"] == "rag"
    }
    return explained, entries


def _unchanged(alone: dict, together: dict) -> tuple[int, int]:
    keys = set(alone) | set(together)
    return sum(alone.get(k) == together.get(k) for k in keys), len(keys)


@benchmark("neighbours")
def neighbours(quick: bool) -> list[Figure]:
    fleet = _fleet_module()
    seeds, minutes = ((1,), 20) if quick else ((1, 2, 3), 45)
    same = {"explain": [0, 0], "divergences": [0, 0]}
    for seed in seeds:
        rng = random.Random(seed)
        with (
            tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
            open_store(f"chdb://{directory}/store") as store,
        ):
            fl = fleet.Fleet(store)
            hosts = _first_service(fleet, fl, rng, minutes)
            sample = sorted(fl.requests)[:: 10 if quick else 3]
            alone = _answers(store, sample)
            _neighbours(fleet, store, fl.t0, hosts, rng, minutes)
            together = _answers(store, sample)
        for view, a, b in (("explain", alone[0], together[0]), ("divergences", alone[1], together[1])):
            n, of = _unchanged(a, b)
            same[view][0] += n
            same[view][1] += of
    fleets = f"{len(seeds)} fleet{'s' if len(seeds) > 1 else ''}"
    return [
        Figure(f"{view}: answers unchanged by three neighbours ({n} of {of}, {fleets})", 100 * n / of, "%", "aim", 98.0)
        for view, (n, of) in same.items()
    ]


# -- concurrent configuration faults
# names the configuration detector does not write: (on the resource?, name, a healthy value, the faulty value)
CONFIGURATIONS = [
    (True, "acme.gpu.sku", "H200", "B300"),
    (True, "acme.driver", "550.54", "575.10"),
    (False, "engine.attention.impl", "flash", "triton"),
    (False, "engine.kv.dtype", "bf16", "fp8"),
    (False, "engine.speculative", "", "on"),
    (True, "acme.cuda.runtime", "12.8", "13.0"),
    (False, "engine.chunked.prefill", "off", "on"),
]


def _concurrent(fleet, store, rng: random.Random, minutes: int) -> tuple[object, dict]:
    faults = rng.sample(CONFIGURATIONS, rng.choice((5, 6)))
    healthy = [f"c{i}" for i in range(1, 7)]
    resources, decode = {}, {}
    for i, host in enumerate(healthy):  # heterogeneous: the healthy hosts differ among themselves too
        resources[host] = {
            "acme.gpu.sku": "H200" if i % 2 else "H100",
            "acme.driver": "550.54" if i < 3 else "560.35",
            "acme.cuda.runtime": "12.8",
            "acme.log.level": "info",
        }
    own = {}
    for k, (on_resource, name, _, value) in enumerate(faults):
        host = f"f{k + 1}"
        resources[host] = {
            "acme.gpu.sku": "H200",
            "acme.driver": "550.54",
            "acme.cuda.runtime": "12.8",
            "acme.log.level": "info",
        }
        if on_resource:
            resources[host][name] = value
        else:
            decode[host] = {name: value}
        own[host] = (name, value, rng.choice((1.0, 1.0, 0.75, 0.5)))  # the share of its requests the fault changes
    resources["x1"] = {**resources["c1"], "acme.log.level": "debug"}  # differs harmlessly
    fl = fleet.Fleet(store, resources=resources)
    defaults = {name: value for on_resource, name, value, _ in CONFIGURATIONS if not on_resource and value}
    hosts = [*healthy, *own, "x1"]
    for i, t, host in fleet.timeline(fl.at(0), fl.at(minutes), 4 * fleet.SECOND, hosts):
        differs = {}
        if host in own and (i * 7919 % 100) < 100 * own[host][2]:
            differs["decode"] = host
        fl.request(
            f"r-{i:04d}",
            t,
            host,
            prompt=rng.randrange(4),
            extra={"decode": {**defaults, **decode.get(host, {})}},
            differs=differs,
        )
    fl.flush()
    return fl, own


@benchmark("concurrent_faults")
def concurrent_faults(quick: bool) -> list[Figure]:
    fleet = _fleet_module()
    seeds, minutes = ((1,), 15) if quick else ((1, 2), 40)
    right = {"explain": [0, 0], "divergences": [0, 0]}
    for seed in seeds:
        rng = random.Random(seed)
        with (
            tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
            open_store(f"chdb://{directory}/store") as store,
        ):
            fl, own = _concurrent(fleet, store, rng, minutes)
            deviating = [rid for rid, r in sorted(fl.requests.items()) if r["differs"]]

            def named(rid: str, stage, top) -> bool:
                name, value, _ = own[fl.requests[rid]["host"]]
                return top is not None and (stage, top[2], top[3]) == ("decode", name, value)

            explainer = Explainer(store)
            for rid in deviating[:: 8 if quick else 2]:
                r = explainer.explain(rid).to_json()
                right["explain"][0] += named(rid, r["first_divergent_stage"], _top(r["causes"]))
                right["explain"][1] += 1
            found = divergences.find(store, SINCE_NS, limit=None)
            entries = {d["request_id"]: d for g in found["groups"] for d in g["deviating"]}
            for rid in deviating:
                d = entries.get(rid)
                right["divergences"][0] += bool(d) and named(rid, d["first_divergent_stage"], _top([d["top_cause"]]))
                right["divergences"][1] += 1
    fleets = f"{len(seeds)} fleet{'s' if len(seeds) > 1 else ''}"
    return [
        Figure(
            f"{view}: the host's own setting first ({n} of {of} deviating requests, {fleets})",
            100 * n / of,
            "%",
            "aim",
            95.0,
        )
        for view, (n, of) in right.items()
    ]


if __name__ == "__main__":  # both benchmarks, printed, whichever tree is first on the path
    for name, function in (("neighbours", neighbours), ("concurrent_faults", concurrent_faults)):
        for figure in function("--quick" in sys.argv):
            print(f"{name} | {figure.name} | {figure.value:.1f} {figure.unit}")
