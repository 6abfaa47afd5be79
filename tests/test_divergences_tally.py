"""``divergences`` says what it did, whatever ``--limit`` is: the tally covers every deviating request in the window,
the deviating count is the same for every limit, and the header says how many were analysed in full.

The class of case: a fleet whose largest fault is older than the newest deviating requests (a stale index on one
host for the first minutes, then a smaller fault elsewhere), so a limit that analyses only the newest requests in
full never reaches the largest fault's. The fleet is recorded through the span exporter into a real store
(``tests/fleet.py``), and every figure is derived from how it was built.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

from stagetrace.analysis import divergences

_spec = importlib.util.spec_from_file_location("stagetrace_tests_fleet", Path(__file__).with_name("fleet.py"))
fleet = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = fleet
    _spec.loader.exec_module(fleet)

INDEX, STEP = "retrieval.index.version", "model.weights.step"
TALLY_KEYS = {"cause", "stage", "service", "requests", "analysed", "hosts", "first_seen", "last_seen"}


def _older_and_newer(store, older: tuple[str, dict | None, dict], prefix: str = "r"):
    """Hosts a..d, each prompt served three times a minute per host for eight minutes. Minutes 0-4: the ``older``
    fault (host, settings, stages that differ); minutes 5-7: host c serves other weights (decode differs). (the
    fleet, the request IDs of each fault)."""
    fl = fleet.Fleet(store)
    old, new = [], []
    n = 0
    for minute in range(8):
        for k in range(3):
            for host in "abcd":
                for prompt in range(2):
                    at = fl.at(minute, seconds=20 * k + n % 20)
                    faulty = host == older[0] and minute < 5
                    other_weights = host == "c" and minute >= 5
                    fl.request(
                        f"{prefix}{n}",
                        at,
                        host,
                        prompt=prompt,
                        settings=older[1] if faulty else {STEP: 1100} if other_weights else None,
                        differs=older[2] if faulty else {"decode": "w"} if other_weights else None,
                    )
                    (old if faulty else new if other_weights else []).append(f"{prefix}{n}")
                    n += 1
    fl.flush()
    return fl, old, new


def _two_faults(store):
    """The older fault a stale index on host a (retrieval differs)."""
    return _older_and_newer(store, ("a", {INDEX: "v40"}, {"retrieval": "stale"}))


def _report(store, fl, limit):
    """The window's divergences as ``stagetrace divergences`` finds them: computed and stored."""
    until = max(r["end_ns"] for r in fl.requests.values()) + fleet.MINUTE
    report = divergences.compute(store, until - fl.t0 + fleet.MINUTE, until_ns=until, limit=limit)
    divergences.record(store, report)
    return report


def _find(store, fl, limit):
    return _report(store, fl, limit).to_json()


def test_the_tally_covers_every_deviating_request_and_the_count_ignores_the_limit(store):
    fl, old, new = _two_faults(store)
    assert len(old) > len(new) > 5  # the largest fault is the older one
    reports = {limit: _report(store, fl, limit) for limit in (5, len(new) + 2, None)}
    found = {limit: report.to_json() for limit, report in reports.items()}
    for limit, result in found.items():
        rows = [i["request_id"] for g in result["groups"] for i in g["deviating"]]
        assert result["deviating"] == len(old) + len(new), (limit, result["deviating"])  # the same for every limit
        assert result["analysed"] == len(rows) == min(limit or len(old) + len(new), len(old) + len(new))
        tally = result["tally"]
        assert all(set(t) == TALLY_KEYS for t in tally), tally
        assert sum(t["requests"] for t in tally) == result["deviating"]  # every deviating request, analysed or not
        assert sum(t["analysed"] for t in tally) == result["analysed"]
        by = {(t["cause"], t["stage"]): t for t in tally}
        # the older, larger fault is in the tally at every limit, with its setting as the cause and its host
        stale = by[(INDEX, "retrieval")]
        assert (stale["requests"], stale["hosts"]) == (len(old), ["a"]), tally
        assert tally[0] is stale  # most first
        assert by[(STEP, "decode")]["requests"] == len(new), tally
        if limit == 5:  # the newest five are the newer fault's: the older one was tallied, not analysed in full
            assert stale["analysed"] == 0 and set(rows) <= set(new)
    assert found[None]["tally"] == [{**t, "analysed": t["requests"]} for t in found[5]["tally"]]

    # the header says how many were analysed in full and how to analyse all; the tally's table shows both counts
    from rich.console import Console

    from stagetrace.render import Output, divergence_groups

    for limit, result in found.items():
        piped = io.StringIO()
        divergence_groups(Output(Console(file=piped)), reports[limit], "3h")
        text = piped.getvalue()
        header = text.splitlines()[0]
        assert header.startswith(f"{len(old) + len(new)} deviating requests in the last 3h"), header
        assert (f"the latest {result['analysed']} analysed in full (--limit 0 analyses all)" in header) == (
            limit is not None
        ), header
        analysed = next(t["analysed"] for t in result["tally"] if t["cause"] == INDEX)
        assert f"{INDEX}\tretrieval\t{len(old)}\t{analysed}\ta\t" in text, text


def test_past_the_tally_bound_the_tally_covers_the_analysed_and_says_so(store, monkeypatch):
    """Tallying every deviating request costs a join over each one's stages: past ``TALLY_ALL_MAX`` deviating
    requests the tally covers those analysed in full, the count stays whole, and the output says so."""
    import io

    from rich.console import Console

    from stagetrace.render import Output, divergence_groups

    fl, old, new = _two_faults(store)
    monkeypatch.setattr(divergences, "TALLY_ALL_MAX", len(old) + len(new) - 1)
    report = _report(store, fl, 5)
    result = report.to_json()
    assert result["tally_covers"] == "analysed" and result["deviating"] == len(old) + len(new)
    assert sum(t["requests"] for t in result["tally"]) == result["analysed"] == 5
    piped = io.StringIO()
    divergence_groups(Output(Console(file=piped)), report, "3h")
    assert (
        f"the tally below covers the 5 analysed in full, not all {len(old) + len(new)}: so many take long to "
        "tally one by one (--limit 0 tallies all)"
    ) in piped.getvalue()
    assert _find(store, fl, None)["tally_covers"] == "analysed"  # --limit 0: every one analysed, so tallied


def test_a_fault_no_setting_explains_is_tallied_without_naming_an_identity(store):
    """A host whose decode outputs differ with nothing recorded against it (what a GPU fault looks like in SQL, which
    reads no counters), older than a weights change on another host (the neighbour, analysed in full). Its requests,
    tallied but not analysed, have no cause: their host and GPU say where they ran, not why, and the tally line
    lists the host; the neighbour keeps its setting."""
    from stagetrace import conventions

    fl, silent, weights = _older_and_newer(store, ("b", None, {"decode": "bad-gpu"}), prefix="s")
    result = _find(store, fl, 5)
    by_host = {tuple(t["hosts"]): t for t in result["tally"]}
    unexplained = by_host[("b",)]
    assert unexplained["requests"] == len(silent) and unexplained["analysed"] == 0, result["tally"]
    assert unexplained["cause"] == "", unexplained  # not host.name, gpu.uuid or any identity
    assert not any(conventions.is_identity(t["cause"]) for t in result["tally"]), result["tally"]
    assert by_host[("c",)]["cause"] == STEP and by_host[("c",)]["requests"] == len(weights), result["tally"]
