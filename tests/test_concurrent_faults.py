"""Several hosts wrong at once, each for its own reason: one fault never hides another (issue 51).

A heterogeneous fleet (two GPU SKUs and two drivers among its healthy hosts) in which five hosts deviate at decode
in the same hours, each for a configuration difference of its own, recorded under names stagetrace's configuration
detector does not write (on the resource or on the decode span), beside a host whose configuration differs
harmlessly. Every deviating request is named by its own host's setting (never by the host, its GPU or another
host's setting), in ``explain``, in ``divergences`` (and its tally) and by the live analyser; the harmless setting
by none. Built from the class of case (docs/design.md#what-the-baseline-must-respect, "A store is shared, and
faults overlap").
"""

from __future__ import annotations


import pytest

from tests import fleet

from stagetrace.analysis import divergences, live
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store

SECOND = fleet.SECOND
HEALTHY = {
    f"c{i}": {"acme.gpu.sku": "H200" if i <= 3 else "H100", "acme.driver": "550.54" if i % 2 else "560.35"}
    for i in range(1, 7)
}
HARMLESS = ("x1", "resource:acme.log.level", "debug")  # differs, changes nothing
# host → (contrast key, its value there): each faulty host's own difference
FAULTS = {
    "f1": ("resource:acme.gpu.sku", "B300"),
    "f2": ("resource:acme.driver", "575.10"),
    "f3": ("engine.attention.impl", "triton"),
    "f4": ("engine.kv.dtype", "fp8"),
    "f5": ("engine.speculative", "on"),  # recorded on that host only
}
DEFAULTS = {"engine.attention.impl": "flash", "engine.kv.dtype": "bf16"}


def _fleet(store) -> fleet.Fleet:
    resources = {host: dict(values, **{"acme.log.level": "info"}) for host, values in HEALTHY.items()}
    for host, (key, value) in FAULTS.items():
        resources[host] = {"acme.gpu.sku": "H200", "acme.driver": "550.54", "acme.log.level": "info"}
        if key.startswith("resource:"):
            resources[host][key.removeprefix("resource:")] = value
    resources[HARMLESS[0]] = {"acme.gpu.sku": "H100", "acme.driver": "560.35", "acme.log.level": HARMLESS[2]}
    fl = fleet.Fleet(store, resources=resources)
    hosts = [*HEALTHY, *FAULTS, HARMLESS[0]]
    for i, t, host in fleet.timeline(fl.at(0), fl.at(50), 4 * SECOND, hosts):
        decode = dict(DEFAULTS)
        differs = {}
        if host in FAULTS:
            key, value = FAULTS[host]
            if not key.startswith("resource:"):
                decode[key] = value
            if host != "f5" or i % 4:  # speculative decoding changes some outputs, not all
                differs["decode"] = host
        fl.request(f"r-{i:04d}", t, host, prompt=i % 4, extra={"decode": decode}, differs=differs)
    fl.flush()
    return fl


@pytest.fixture(scope="module")
def fleet_answers(tmp_path_factory):
    with open_store(f"chdb://{tmp_path_factory.mktemp('concurrent') / 'store'}") as store:
        fl = _fleet(store)
        live.Analyser(store, live.Schedule(settle_s=0, lookback_s=3 * 3600)).step()
        rows = store.client.query(
            "SELECT RequestId, FirstDivergentStage, TopCauseName, TopCauseValue "
            "FROM {db:Identifier}.stagetrace_divergences FINAL",
            parameters={"db": store.database},
        ).result_rows
        found = divergences.find(store, 24 * 3600 * SECOND, limit=None)
        deviating = [rid for rid, r in sorted(fl.requests.items()) if r["differs"]]
        explainer = Explainer(store)
        explained = {rid: explainer.explain(rid).to_json() for rid in deviating[::2]}
    return fl, found, explained, {r[0]: r[1:] for r in rows}


def _own(fl, rid: str) -> tuple[str, str, str]:
    key, value = FAULTS[fl.requests[rid]["host"]]
    return "decode", key.removeprefix("resource:"), value


def test_explain_names_each_hosts_own_setting(fleet_answers):
    fl, _, explained, _ = fleet_answers
    assert len(explained) >= 100
    wrong = {}
    for rid, report in explained.items():
        top = next(c for c in report["causes"] if not c["weak"])
        if (report["first_divergent_stage"], top["name"], top["value"]) != _own(fl, rid):
            wrong[rid] = (fl.requests[rid]["host"], report["summary"])
    assert not wrong, f"{len(wrong)} of {len(explained)}: {sorted(wrong.items())[:3]}"


def test_divergences_and_its_tally_name_each_hosts_own_setting(fleet_answers):
    fl, found, _, _ = fleet_answers
    entries = {d["request_id"]: d for g in found["groups"] for d in g["deviating"]}
    assert set(entries) == {rid for rid, r in fl.requests.items() if r["differs"]}  # the harmless host agrees
    wrong = {
        rid: (fl.requests[rid]["host"], d["summary"])
        for rid, d in entries.items()
        if (d["first_divergent_stage"], d["top_cause"]["name"], d["top_cause"]["value"]) != _own(fl, rid)
    }
    assert not wrong, f"{len(wrong)} of {len(entries)}: {sorted(wrong.items())[:3]}"
    tally = {(t["cause"], t["stage"]): t["hosts"] for t in found["tally"]}
    assert tally == {(key.removeprefix("resource:"), "decode"): [host] for host, (key, _) in FAULTS.items()}


def test_the_live_analyser_agrees(fleet_answers):
    fl, _, explained, rows = fleet_answers
    assert {rid for rid in rows} == {rid for rid, r in fl.requests.items() if r["differs"]}
    for rid, (stage, name, value) in rows.items():
        assert (stage, name, value) == _own(fl, rid), (rid, fl.requests[rid]["host"])


def test_the_harmless_difference_and_the_identities_are_never_first(fleet_answers):
    _, found, explained, _ = fleet_answers
    firsts = {next(c for c in r["causes"] if not c["weak"])["name"] for r in explained.values()}
    firsts |= {d["top_cause"]["name"] for g in found["groups"] for d in g["deviating"]}
    assert not firsts & {"host.name", "gpu.uuid", HARMLESS[1].removeprefix("resource:")}, firsts
