"""Attribution that holds on real fleets: rollouts, faults after them, lagging hosts, identity of settings,
remote TP ranks, nondeterminism by design, and divergences nothing recorded explains.

Each test records a small simulated fleet (``tests/fleet.py``: several hosts, explicit timestamps over simulated
minutes, per-stage settings and measurements, TP ranks on their own hosts) into a real embedded store, then checks
what ``Explainer.explain`` and ``divergences.find`` conclude. The fleets stand for classes of cases operators meet
(docs/design.md#what-the-baseline-must-respect), not for any demo: every verdict is derived from how the fleet was
built, never from numbers tuned to an implementation.

Every explain report also goes through :func:`checked`, the contract every report keeps (causes best first, all
scores positive, the baseline's request ID in the summary, content and identifiers never causes, a measurement
never first unless weak).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stagetrace import conventions, lookup
from stagetrace.analysis import divergences, live
from stagetrace.analysis.explain import Explainer

_spec = importlib.util.spec_from_file_location("stagetrace_tests_fleet", Path(__file__).with_name("fleet.py"))
fleet = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fleet
_spec.loader.exec_module(fleet)

MINUTE, SECOND = fleet.MINUTE, fleet.SECOND
NOTHING_EXPLAINS = "no recorded setting or hardware signal differs"
REPORT_KEYS = {
    "diverged",
    "first_divergent_stage",
    "divergent_ranks",
    "baseline",
    "nondeterministic",
    "nondeterminism",
    "expected",
    "rollouts",
    "causes",
    "summary",
}
CAUSE_KEYS = {"kind", "stage", "name", "value", "baseline_value", "score", "weak"}
ROLLOUT_KEYS = {"stage", "name", "old", "new", "from_ns", "to_ns", "hosts", "of_hosts"}
INDEX = "retrieval.index.version"


# -- the contract every report keeps
def checked(report: dict) -> dict:
    missing = REPORT_KEYS - set(report)
    assert not missing, f"the report lacks {sorted(missing)}"
    causes = report["causes"]
    scores = [c["score"] for c in causes]  # their order: conftest's _check_verdict, as for every report
    assert all(s > 0 for s in scores), f"every listed cause scores above zero: {scores}"
    for cause in causes:
        assert CAUSE_KEYS <= set(cause), f"cause lacks {sorted(CAUSE_KEYS - set(cause))}: {cause}"
        assert cause["kind"] in ("attribute", "hardware", "rollout", "nondeterminism", "weights"), cause
        assert isinstance(cause["weak"], bool), cause
        if cause["kind"] == "hardware":
            assert {"host", "device", "rank"} <= set(cause), cause
        if cause["kind"] == "attribute":
            assert not conventions.is_content(cause["name"]), f"a stage's output is never a cause: {cause}"
            assert cause["name"] not in conventions.IDENTIFIER_KEYS, f"an identifier is never a cause: {cause}"
    if causes and causes[0]["kind"] == "attribute" and conventions.is_measurement(causes[0]["name"]):
        assert causes[0]["weak"], f"a measurement is ranked first without being weak: {causes[0]}"
    if NOTHING_EXPLAINS in report["summary"]:
        assert all(c["weak"] for c in causes), causes
    baseline = report["baseline"]
    if baseline is not None:
        assert {"request_id", "how", "support", "group_size"} <= set(baseline), baseline
        assert baseline["request_id"] in report["summary"], (baseline, report["summary"])
    assert isinstance(report["nondeterministic"], bool)
    if report["nondeterministic"]:
        assert isinstance(report["nondeterminism"], str) and report["nondeterminism"]
    else:
        assert report["nondeterminism"] is None
    assert isinstance(report["expected"], bool)
    assert isinstance(report["divergent_ranks"], list) and all(isinstance(r, str) for r in report["divergent_ranks"])
    for rollout in report["rollouts"]:
        assert ROLLOUT_KEYS <= set(rollout), rollout
    return report


def explain(store, request_id: str, against: str | None = None) -> dict:
    from stagetrace.analysis.explain import Explainer

    return checked(Explainer(store).explain(request_id, against).to_json())


def find(store, fl) -> dict:
    """Divergences over the whole simulated fleet, every deviating request analysed."""
    from stagetrace.analysis import divergences

    until = max(r["end_ns"] for r in fl.requests.values()) + MINUTE
    found = divergences.find(store, until - fl.t0 + MINUTE, until_ns=until, limit=None)
    assert {"deviating", "nondeterministic", "rollouts", "groups"} <= set(found), sorted(found)
    for rollout in found["rollouts"]:
        assert ROLLOUT_KEYS <= set(rollout), rollout
    return found


def deviating(found: dict) -> dict[str, dict]:
    return {item["request_id"]: item for group in found["groups"] for item in group["deviating"]}


def top(report: dict) -> dict:
    assert report["causes"], f"no cause: {report['summary']}"
    return report["causes"][0]


def verdict(cause: dict) -> tuple:
    return cause["kind"], cause["stage"], cause["name"], str(cause["value"]), str(cause["baseline_value"])


# -- fleets
EVERY = 20 * SECOND


def rollout_fleet(store, hosts: list[str], switch_min: dict[str, float], end_min: float, fault=None):
    """Requests every 20 s, round-robin over ``hosts``, three prompts; each host moves its index v41 -> v42 at its
    ``switch_min`` (never, when absent). The new index returns other documents for prompts 0 and 1, the same for 2.
    ``fault(host, ns since the fleet's start)`` -> ``(stage, key, value)`` or None: a setting wrong on that request,
    changing that stage's output (for every prompt)."""
    fl = fleet.Fleet(store)
    for i, t, host in fleet.timeline(fl.t0, fl.at(end_min), EVERY, hosts):
        prompt = i % 3
        moved = host in switch_min and t >= fl.at(switch_min[host])
        settings = {INDEX: "v42" if moved else "v41"}
        differs = {"retrieval": "v42"} if moved and prompt in (0, 1) else {}
        wrong = fault(host, t - fl.t0) if fault else None
        if wrong:
            stage, key, value = wrong
            settings[key] = value
            differs[stage] = f"{key}={value}"
        fl.request(f"req-{i:03d}", t, host, prompt=prompt, settings=settings, differs=differs)
    fl.flush()
    return fl


def served(fl, request_id: str) -> str:
    return fl.requests[request_id]["settings"][INDEX]


def wave(fl, hosts) -> tuple[dict[str, int], dict[str, int]]:
    """Per host: the start of its first request on v42, and of its last one on v41."""
    first_new, last_old = {}, {}
    for r in sorted(fl.requests.values(), key=lambda r: r["start_ns"]):
        if r["settings"][INDEX] == "v42":
            first_new.setdefault(r["host"], r["start_ns"])
        else:
            last_old[r["host"]] = r["start_ns"]
    return first_new, last_old


TP_RANKS = [
    fleet.Rank(0, "node-a", ("mlx5_0",), "GPU-a0"),
    fleet.Rank(1, "node-a", ("mlx5_1",), "GPU-a1"),
    fleet.Rank(2, "node-b", ("mlx5_0",), "GPU-b0"),
    fleet.Rank(3, "node-b", ("mlx5_1",), "GPU-b1"),
]
TP_DEVIATING = 14  # the request whose all-reduce went wrong on rank 3's link (host B, mlx5_1)


def tp_fleet(store, requests: int = 24):
    """TP=4 over two hosts, one request a minute; ``allreduce`` one span per rank on its own host with its NIC.
    Host B's mlx5_1 counts packet sequence errors only around request ``TP_DEVIATING``, whose rank-3 result differs."""
    fl = fleet.Fleet(store)
    for i in range(requests):
        bad = i == TP_DEVIATING
        fl.request(
            f"tp-{i:02d}",
            fl.at(minutes=i, seconds=3),
            "node-a",
            prompt=i % 2,
            gpu="GPU-a0",
            tp=TP_RANKS,
            rank_differs={3: "seq-err"} if bad else None,
            measures={"allreduce.time_ms": 41.5} if bad else None,
        )
    fl.flush()
    dev_start = fl.requests[f"tp-{TP_DEVIATING:02d}"]["start_ns"]
    t0, t1 = fl.t0 - MINUTE, fl.at(minutes=requests + 1)
    for host in ("node-a", "node-b"):
        for nic in ("mlx5_0", "mlx5_1"):
            labels = {"device": nic, "port": "1"}
            # the first scrape after the deviating request started sees 3 more errors, and only that link
            rises = ((dev_start + 12 * SECOND, 3.0),) if (host, nic) == ("node-b", "mlx5_1") else ()
            fl.counter(host, "rdma_packet_seq_err_total", labels, t0, t1, value=40, rises=rises)
            fl.counter(
                host,
                "rdma_port_transmit_bytes_total",
                labels,
                t0,
                t1,
                value=1e9,
                rises=tuple((t, 4e6) for t in range(t0, t1, 15 * SECOND)),
            )
    return fl


def flat_hardware(fl, hosts_gpus: dict[str, list[str]], nics=("mlx5_0",)) -> None:
    """Hardware that was scraped all along and shows nothing: no error counter rose anywhere."""
    t0, t1 = fl.t0 - MINUTE, max(r["end_ns"] for r in fl.requests.values()) + MINUTE
    for host, gpus in hosts_gpus.items():
        for n, uuid in enumerate(gpus):
            labels = {"gpu": str(n), "uuid": uuid, "model": "H200"}
            fl.counter(host, "gpu_ecc_errors_total", {**labels, "type": "uncorrected"}, t0, t1, value=0)
            fl.counter(
                host,
                "gpu_energy_joules_total",
                labels,
                t0,
                t1,
                value=5e6,
                rises=tuple((t, 9e3) for t in range(t0, t1, 15 * SECOND)),
            )
        for nic in nics:
            fl.counter(host, "rdma_packet_seq_err_total", {"device": nic, "port": "1"}, t0, t1, value=5)


# -- the helper records what it says (these pass whatever the analysis does)
def test_fleet_helper_records_ranks_hosts_times_and_digests(store):
    """Not a fleet case: checks that tests/fleet.py writes what the other tests rely on."""
    fl = tp_fleet(store, requests=16)
    rid = f"tp-{TP_DEVIATING:02d}"
    trace = lookup.by_request_id(store, rid)
    assert trace.start_ns == fl.requests[rid]["start_ns"] == fl.at(minutes=TP_DEVIATING, seconds=3)
    assert len(trace.spans) == 1 + 4 + 4  # root, four single stages, allreduce once per rank
    ranks = {
        s.rank: (s.resource["host.name"], json.loads(s.attributes["net.rdma.devices"]), s.output_digest)
        for s in trace.spans
        if s.stage == "allreduce"
    }
    assert {r: v[:2] for r, v in ranks.items()} == {
        "0": ("node-a", ["mlx5_0"]),
        "1": ("node-a", ["mlx5_1"]),
        "2": ("node-b", ["mlx5_0"]),
        "3": ("node-b", ["mlx5_1"]),
    }
    assert len({v[2] for r, v in ranks.items() if r != "3"}) == 1 and ranks["3"][2] != ranks["0"][2]
    peer = lookup.by_request_id(store, f"tp-{TP_DEVIATING - 2:02d}")  # same prompt, nothing wrong
    assert peer.input_digest == trace.input_digest and peer.output_digest != trace.output_digest
    mine = {(s.stage, s.rank): s for s in trace.spans if s.stage}
    theirs = {(s.stage, s.rank): s for s in peer.spans if s.stage}
    for key in [("retrieval", ""), ("cache", ""), ("context_assembly", ""), ("allreduce", "0"), ("allreduce", "3")]:
        assert mine[key].input_digest == theirs[key].input_digest, key
    assert mine[("allreduce", "0")].output_digest == theirs[("allreduce", "0")].output_digest
    assert mine[("allreduce", "3")].output_digest != theirs[("allreduce", "3")].output_digest
    assert mine[("decode", "")].input_digest != theirs[("decode", "")].input_digest  # the difference flows on
    assert mine[("allreduce", "3")].attributes["allreduce.time_ms"] == "41.5"
    rows = store.client.query(
        "SELECT RequestId, toUnixTimestamp64Nano(Start), HostName FROM {db:Identifier}.stagetrace_requests ORDER BY Start",
        parameters={"db": store.database},
    ).result_rows
    assert rows == [(r, fl.requests[r]["start_ns"], "node-a") for r in sorted(fl.requests)]
    points = store.client.query(
        "SELECT ResourceAttributes['host.name'], Attributes['device'], max(Value) - min(Value) "
        "FROM {db:Identifier}.otel_metrics_sum WHERE MetricName = 'rdma_packet_seq_err_total' GROUP BY 1, 2 ORDER BY 1, 2",
        parameters={"db": store.database},
    ).result_rows
    assert points == [
        ("node-a", "mlx5_0", 0.0),
        ("node-a", "mlx5_1", 0.0),
        ("node-b", "mlx5_0", 0.0),
        ("node-b", "mlx5_1", 3.0),
    ]


def test_fleet_helper_rollout_schedule(store):
    """Not a fleet case: the rollout fleet moves each host at its time, and only prompts 0 and 1 change output."""
    switch = {"node-1": 15, "node-2": 16, "node-3": 17, "node-4": 18}
    fl = rollout_fleet(store, ["node-1", "node-2", "node-3", "node-4", "node-5"], switch, 30)
    rows = store.client.query(
        "SELECT s.HostName, toUnixTimestamp64Nano(s.Start), s.Attributes[{key:String}], s.OutputDigest, r.RequestId "
        "FROM {db:Identifier}.stagetrace_stages AS s INNER JOIN {db:Identifier}.stagetrace_requests AS r USING TraceId "
        "WHERE s.Stage = 'retrieval'",
        parameters={"db": store.database, "key": INDEX},
    ).result_rows
    assert len(rows) == len(fl.requests) == 90
    outputs: dict[tuple[int, str], set[str]] = {}
    for host, start, version, out, rid in rows:
        assert version == ("v42" if host in switch and start >= fl.at(switch[host]) else "v41"), (host, start)
        outputs.setdefault((fl.requests[rid]["prompt"], version), set()).add(out)
    assert all(len(v) == 1 for v in outputs.values())
    assert outputs[(0, "v41")] != outputs[(0, "v42")] and outputs[(1, "v41")] != outputs[(1, "v42")]
    assert outputs[(2, "v41")] == outputs[(2, "v42")]


# -- (1) a rollout is a normal move
HOSTS4 = ["node-1", "node-2", "node-3", "node-4"]
WAVE4 = {"node-1": 24, "node-2": 25.2, "node-3": 26.4, "node-4": 27.6}


def test_rollout_wave_is_reported_once_and_is_no_deviation(store):
    """Class: an index rebuild rolled out host by host over a few minutes, mid-window, changing some outputs.
    It is a rollout (what, when, how widely), reported once; requests after it are compared with each other, not
    with the old majority; a request served by a moved host during the wave is an expected change."""
    fl = rollout_fleet(store, HOSTS4, WAVE4, 40)
    first_new, last_old = wave(fl, HOSTS4)
    found = find(store, fl)
    assert len(found["rollouts"]) == 1, found["rollouts"]
    [rollout] = found["rollouts"]
    assert (rollout["stage"], rollout["name"], rollout["old"], rollout["new"]) == ("retrieval", INDEX, "v41", "v42")
    assert rollout["hosts"] == rollout["of_hosts"] == 4
    leader = min(first_new, key=first_new.get)
    # a second of slack: a rollout may be dated by its stage spans, which start just after their requests
    assert last_old[leader] < rollout["from_ns"] <= first_new[leader] + SECOND, (
        "the wave starts when the first host moved"
    )
    assert max(last_old.values()) <= rollout["to_ns"] <= max(first_new.values()) + SECOND, "and ends when the last did"
    assert found["deviating"] == 0 and deviating(found) == {}, sorted(deviating(found))

    changed = [r for r in fl.requests.values() if r["differs"]]  # served by v42, with another output than v41's
    during = [r for r in changed if r["start_ns"] < max(first_new.values())]
    assert during, "the fleet has a changed output inside the wave"
    report = explain(store, during[0]["request_id"])
    assert report["expected"] is True, report["summary"]
    assert any(
        (r["stage"], r["name"], r["old"], r["new"]) == ("retrieval", INDEX, "v41", "v42") for r in report["rollouts"]
    )
    assert report["nondeterministic"] is False

    after = explain(store, changed[-1]["request_id"])  # well after the wave: its peers are the requests after it
    assert after["diverged"] is False, after["summary"]
    assert served(fl, after["baseline"]["request_id"]) == "v42"
    before = next(
        r for r in fl.requests.values() if r["prompt"] == 0 and r["start_ns"] > fl.at(20) and not r["differs"]
    )
    earlier = explain(store, before["request_id"])  # the rollout does not make the requests before it look wrong
    assert earlier["diverged"] is False and served(fl, earlier["baseline"]["request_id"]) == "v41"


# -- (2) a real fault after a rollout
@pytest.mark.parametrize(
    ("stage", "key", "good", "bad"),
    [
        ("context_assembly", "context.max_tokens", 4096, 2048),
        ("decode", "decode.batch_size", 16, 32),
    ],
)
def test_fault_on_one_host_after_a_rollout_is_blamed_on_its_setting(store, stage, key, good, bad):
    """Class: after the fleet moved to a new index, one host starts serving a wrong setting (a config push that
    reached one node). Its requests deviate from their post-rollout peers because of that setting: not because of the
    rollout's key (the baseline is a request after the rollout) and not because of the host's name."""
    fl = rollout_fleet(
        store,
        HOSTS4,
        WAVE4,
        40,
        fault=lambda host, since: (stage, key, bad) if host == "node-3" and since >= 33 * MINUTE else None,
    )
    faulty = sorted(r["request_id"] for r in fl.requests.values() if r["settings"].get(key) == bad)
    assert len(faulty) >= 4

    report = explain(store, faulty[-1])
    assert report["diverged"] and report["first_divergent_stage"] == stage, report["summary"]
    assert verdict(top(report)) == ("attribute", stage, key, str(bad), str(good)), report["causes"][:3]
    assert top(report)["weak"] is False
    assert INDEX not in [c["name"] for c in report["causes"] if c["kind"] == "attribute"], (
        "the baseline is after the rollout"
    )
    assert served(fl, report["baseline"]["request_id"]) == "v42"
    assert report["expected"] is False and report["nondeterministic"] is False

    found = find(store, fl)
    assert [(r["name"], r["hosts"], r["of_hosts"]) for r in found["rollouts"]] == [(INDEX, 4, 4)]
    items = deviating(found)
    assert sorted(items) == faulty and found["deviating"] == len(faulty)
    assert {items[rid]["top_cause"]["name"] for rid in faulty} == {key}


# -- (3) a host the rollout never reached
def test_lagging_host_is_blamed_on_the_rollout_key(store):
    """Class: a rollout reached most of the fleet and stayed, but one host kept serving the old index long after
    the wave (its deploy failed). Its requests deviate from their peers, and the cause is the rollout's setting."""
    hosts = ["node-1", "node-2", "node-3", "node-4", "node-5"]
    switch = {"node-1": 15, "node-2": 16, "node-3": 17, "node-4": 18}  # node-5 never moves
    fl = rollout_fleet(store, hosts, switch, 50)
    first_new, _ = wave(fl, hosts)
    wave_end = max(first_new.values())  # a three-minute wave; the lagging requests come five waves and more after it
    lagging = [
        r["request_id"]
        for r in fl.requests.values()
        if r["host"] == "node-5" and r["prompt"] in (0, 1) and r["start_ns"] >= wave_end + 15 * MINUTE
    ]
    assert len(lagging) >= 5

    report = explain(store, lagging[-1])
    assert report["diverged"] and report["first_divergent_stage"] == "retrieval", report["summary"]
    # the setting, as an attribute difference or as the rollout that never reached the host
    assert verdict(top(report))[1:] == ("retrieval", INDEX, "v41", "v42"), report["causes"][:3]
    assert top(report)["kind"] in ("attribute", "rollout") and top(report)["weak"] is False
    assert report["expected"] is False, "long after the wave, serving the old value is no expected change"
    assert served(fl, report["baseline"]["request_id"]) == "v42"
    assert any(r["name"] == INDEX and r["new"] == "v42" for r in report["rollouts"])

    found = find(store, fl)
    assert [(r["stage"], r["name"], r["old"], r["new"], r["hosts"], r["of_hosts"]) for r in found["rollouts"]] == [
        ("retrieval", INDEX, "v41", "v42", 4, 5)
    ]
    items = deviating(found)
    assert set(lagging) <= set(items), sorted(set(lagging) - set(items))
    assert all(fl.requests[rid]["host"] == "node-5" for rid in items), "only the lagging host deviates"
    assert {items[rid]["top_cause"]["name"] for rid in lagging} == {INDEX}


# -- (4) identity, not magnitude
def test_one_gpu_a_weight_step_behind_is_blamed_on_the_step(store):
    """Class: one GPU loaded the previous checkpoint (step 1199 where the fleet serves 1200). The step differs by
    identity, however close the numbers; timings and token counts move with the output but are effects; the GPU's
    UUID and its host's name are where it happened, not why (the same host's other GPU serves correct outputs)."""
    fl = fleet.Fleet(store)
    gpus = {
        "node-1": ["GPU-node-1-0"],
        "node-2": ["GPU-node-2-0"],
        "node-3": ["GPU-node-3-0", "GPU-node-3-1"],
        "node-4": ["GPU-node-4-0"],
    }
    behind = "GPU-node-3-1"
    for i, t, host in fleet.timeline(fl.t0, fl.at(24), 30 * SECOND, HOSTS4):
        gpu = gpus[host][(i // 8) % len(gpus[host])]
        stale = gpu == behind
        fl.request(
            f"w-{i:02d}",
            t,
            host,
            prompt=(i // 4) % 2,
            gpu=gpu,
            settings={"model.weights.step": 1199} if stale else None,
            differs={"decode": "step1199"} if stale else None,
            measures={"decode.ttft_ms": 231} if stale else None,
        )
    fl.flush()
    flat_hardware(fl, gpus)
    stale = sorted(r["request_id"] for r in fl.requests.values() if r["gpu"] == behind)
    healthy_same_host = [r for r in fl.requests.values() if r["host"] == "node-3" and r["gpu"] != behind]
    assert len(stale) >= 4 and len(healthy_same_host) >= 4

    report = explain(store, stale[-1])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    assert verdict(top(report)) == ("weights", "decode", "model.weights.step", "1199", "1200"), report["causes"][:3]
    assert top(report)["weak"] is False
    assert report["divergent_ranks"] == [], "decode runs as one span here: no rank"
    assert "model.weights.step" in report["summary"] and "1199" in report["summary"]

    found = find(store, fl)
    assert found["rollouts"] == []
    items = deviating(found)
    assert sorted(items) == stale
    assert {items[rid]["top_cause"]["name"] for rid in stale} == {"model.weights.step"}


# -- (5) every rank counts
def test_remote_rank_nic_errors_are_blamed_on_that_host_and_rank(store):
    """Class: multi-node TP (ranks 0-1 on host A, 2-3 on host B); the request's root and decode run on host A, but
    the all-reduce went wrong on host B's link, whose NIC counted packet sequence errors only then. The hardware
    evidence comes from each rank span's own host and NIC: host B, its rank, its device."""
    fl = tp_fleet(store)
    rid = f"tp-{TP_DEVIATING:02d}"
    report = explain(store, rid)
    assert report["diverged"] and report["first_divergent_stage"] == "allreduce", report["summary"]
    assert report["divergent_ranks"] == ["3"], "only rank 3's result differs"
    cause = top(report)
    assert (cause["kind"], cause["stage"], cause["name"]) == ("hardware", "allreduce", "rdma_packet_seq_err_total"), (
        report["causes"][:3]
    )
    assert (cause["host"], cause["device"]) == ("node-b", "mlx5_1")
    assert str(cause["rank"]) in ("2", "3")
    assert cause["weak"] is False
    assert not any(c["kind"] == "hardware" and c.get("host") == "node-a" for c in report["causes"]), (
        "host A showed nothing"
    )
    assert "node-b" in report["summary"]

    found = find(store, fl)
    items = deviating(found)
    assert sorted(items) == [rid] and found["deviating"] == 1
    assert (items[rid]["top_cause"]["name"], items[rid]["top_cause"]["host"]) == ("rdma_packet_seq_err_total", "node-b")
    assert found["rollouts"] == []
    assert fl.requests[rid]["host"] == "node-a"


# -- (6) nondeterminism by design
def sampling_fleet(store, sampling_on: str = "request"):
    """Three groups on two hosts: sampled at temperature 0.8 without a seed (outputs vary by design), sampled at 0.8
    with a seed, and greedy without a seed. In each of the last two, one request ran at another batch size and
    deviates for that reason. Returns the fleet and the IDs (sampled deviators, seeded deviator, greedy deviator)."""
    fl = fleet.Fleet(store)
    hosts = ["node-1", "node-2"]
    sampled_tags = ["", "", "a", "", "b", "", "", "c", ""]
    n = 0
    ids: dict[str, list[str]] = {"sampled": [], "sampled_deviating": [], "seeded": [], "greedy": []}
    for group, prompt, temperature, seed, size in (
        ("sampled", 0, 0.8, None, 9),
        ("seeded", 1, 0.8, 7, 8),
        ("greedy", 2, 0.0, None, 8),
    ):
        for k in range(size):
            rid = f"{group}-{k}"
            kwargs = {}
            if group == "sampled":
                ids["sampled"].append(rid)
                if sampled_tags[k]:
                    kwargs["differs"] = {"decode": sampled_tags[k]}
                    ids["sampled_deviating"].append(rid)
            elif k == 5:
                kwargs = {"settings": {"decode.batch_size": 32}, "differs": {"decode": "batch32"}}
                ids[group].append(rid)
            fl.request(
                rid,
                fl.at(seconds=30 * n),
                hosts[n % 2],
                prompt=prompt,
                temperature=temperature,
                seed=seed,
                sampling_on=sampling_on,
                **kwargs,
            )
            n += 1
    fl.flush()
    return fl, ids


@pytest.mark.parametrize("sampling_on", ["request", "decode"])
def test_sampling_without_a_seed_is_nondeterminism_not_a_deviation(store, sampling_on):
    """Class: requests sampled above temperature zero without a seed (on the request span, or on the engine's decode
    span as vLLM records it) differ by design: the analysis says so, does not blame a cause, and does not count them
    as deviating. With a seed, or greedy, the same kind of difference is a deviation with a cause."""
    fl, ids = sampling_fleet(store, sampling_on)
    for rid in (ids["sampled_deviating"][0], ids["sampled"][0]):
        report = explain(store, rid)
        assert report["nondeterministic"] is True, report["summary"]
        assert "temperature" in report["nondeterminism"]
    report = explain(store, ids["sampled_deviating"][-1])
    if report["causes"]:
        assert top(report)["kind"] == "nondeterminism" or top(report)["weak"], report["causes"][:3]

    for group in ("seeded", "greedy"):
        [rid] = ids[group]
        report = explain(store, rid)
        assert report["nondeterministic"] is False and report["nondeterminism"] is None, (
            group,
            report["nondeterminism"],
        )
        assert report["diverged"] and report["first_divergent_stage"] == "decode"
        assert verdict(top(report)) == ("attribute", "decode", "decode.batch_size", "32", "16"), report["causes"][:3]

    found = find(store, fl)
    assert sorted(deviating(found)) == sorted(ids["seeded"] + ids["greedy"])
    assert found["deviating"] == 2
    assert len(ids["sampled_deviating"]) <= found["nondeterministic"] <= len(ids["sampled"])


def test_declared_nondeterministic_request(store):
    """Class: an app that marks its requests ``stagetrace.nondeterministic = true`` (e.g. speculative decoding with
    a non-deterministic kernel) although greedy and seeded: outputs may differ by design."""
    fl = fleet.Fleet(store)
    for k in range(6):
        fl.request(
            f"flagged-{k}",
            fl.at(seconds=30 * k),
            ["node-1", "node-2"][k % 2],
            prompt=3,
            root={conventions.NONDETERMINISTIC: True},
            differs={"decode": "x"} if k == 4 else None,
        )
    fl.flush()
    report = explain(store, "flagged-4")
    assert report["nondeterministic"] is True and report["nondeterminism"], report["summary"]
    found = find(store, fl)
    assert found["deviating"] == 0 and found["nondeterministic"] >= 1


def test_cli_explain_json_says_nondeterministic(store_dsn):
    """Class: an operator asks the CLI about a sampled request; the JSON says it is nondeterministic by design."""
    from stagetrace.store import open_store

    with open_store(store_dsn) as store:
        _, ids = sampling_fleet(store)
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "explain", ids["sampled_deviating"][0], "--json", "--store", store_dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = checked(json.loads(done.stdout))
    assert report["nondeterministic"] is True and "temperature" in report["nondeterminism"]
    seeded = subprocess.run(
        [sys.executable, "-m", "stagetrace", "explain", ids["seeded"][0], "--json", "--store", store_dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert checked(json.loads(seeded.stdout))["nondeterministic"] is False


# -- (7) when nothing recorded explains it
@pytest.mark.parametrize("origin", ["retrieval", "decode"])
def test_only_effects_differ_says_nothing_recorded_explains_it(store, origin):
    """Class: an output deviates and nothing that sets a request up differs: only its effects (TTFT, token count),
    the stage's own output (the retrieved document IDs) and a per-request sequence number the app attaches
    (``app.request_seq``, declared nowhere) differ, and no hardware counter rose. The verdict says so plainly; what it
    lists are weak candidates; the output and the sequence number are no candidates at all."""
    fl = fleet.Fleet(store)
    hosts = ["node-1", "node-2"]
    odd = 7
    for i in range(12):
        seq = {"app.request_seq": 50_000 + 13 * i}
        extra = {stage: dict(seq) for stage in conventions.PIPELINE_STAGES}
        kwargs = {}
        if i == odd:
            kwargs = {"differs": {origin: "x"}, "measures": {"decode.ttft_ms": 412, "decode.tokens": 233}}
            if origin == "decode":  # the replica renamed its chunks: other IDs, the same documents
                extra["retrieval"]["retrieval.doc_ids"] = ["chunk-91", "chunk-92", "chunk-93"]
        fl.request(f"e-{i:02d}", fl.at(seconds=30 * i), hosts[i % 2], prompt=0, root=seq, extra=extra, **kwargs)
    fl.flush()
    flat_hardware(fl, {h: [f"GPU-{h}-0"] for h in hosts})
    rid = f"e-{odd:02d}"
    report = explain(store, rid)
    assert report["diverged"] and report["first_divergent_stage"] == origin
    assert NOTHING_EXPLAINS in report["summary"], report["summary"]
    assert all(c["weak"] for c in report["causes"]), report["causes"]
    names = [c["name"] for c in report["causes"]]
    assert "retrieval.doc_ids" not in names and "app.request_seq" not in names, names
    assert report["nondeterministic"] is False and report["expected"] is False

    found = find(store, fl)
    items = deviating(found)
    assert sorted(items) == [rid]
    cause = items[rid]["top_cause"]
    assert cause is None or (cause["weak"] and cause["name"] not in ("retrieval.doc_ids", "app.request_seq")), cause


# -- (8) every report keeps the contract
def test_every_report_keeps_the_contract(store):
    """Class: any request an operator looks up, agreeing or not, in a fleet with hardware evidence, TP ranks and
    sampled requests: causes best first, all scores above zero, the baseline's request ID in the summary."""
    fl = tp_fleet(store, requests=18)
    for k in range(6):
        fl.request(
            f"sampled-{k}",
            fl.at(minutes=19 + k, seconds=30),
            "node-a",
            prompt=2,
            temperature=0.8,
            seed=None,
            tp=TP_RANKS,
            differs={"decode": f"s{k % 3}"} if k % 2 else None,
        )
    fl.request(
        "batch32",
        fl.at(minutes=26),
        "node-a",
        prompt=0,
        gpu="GPU-a0",
        tp=TP_RANKS,
        settings={"decode.batch_size": 32},
        differs={"decode": "batch32"},
    )
    fl.flush()
    reports = {rid: explain(store, rid) for rid in fl.requests}  # checked() asserts the contract on each
    assert sum(r["diverged"] for r in reports.values()) >= 2
    assert verdict(top(reports["batch32"])) == ("attribute", "decode", "decode.batch_size", "32", "16")


def test_deviating_output_rule_leaves_out_requests_sampled_without_a_seed(store):
    """A tenant that samples at temperature 0.8 without a seed gets a different output every time: by design, so
    the live analysis, and the deviating-output rule that reads it, must neither count those requests nor let them
    make a majority."""
    from datetime import timedelta, timezone

    import stagetrace
    from stagetrace.dashboards import alert_rules
    from tests.grafana_macros import QueryContext, expand

    store.client.database = store.database  # as the Grafana data source sets it
    stagetrace.configure(store=store, host_name="node-a", service_name="rag")
    prompts = {"greedy": {"prompt": "q", "temperature": 0, "seed": 1}, "sampled": {"prompt": "q", "temperature": 0.8}}
    for i in range(4 * alert_rules.MIN_SAMPLES):  # enough of each for the rule to evaluate
        kind = "greedy" if i % 2 else "sampled"
        attributes = {
            "gen_ai.request.temperature": prompts[kind]["temperature"],
            **({"gen_ai.request.seed": 1} if kind == "greedy" else {}),
        }
        with stagetrace.request(f"{kind}-{i}", input=prompts[kind], attributes=attributes) as req:
            req.set_output("same answer" if kind == "greedy" else f"sampled answer {i % 3 == 0}")  # a 2:1 majority
    stagetrace.flush()
    assert store.client.command("SELECT count() FROM stagetrace_requests") == 4 * alert_rules.MIN_SAMPLES
    done = live.Analyser(store, live.Schedule(settle_s=0)).step()
    assert done is not None and done.analysed == 0
    (rule,) = [r for r in alert_rules.RULES if r.uid == "stagetrace-deviating-outputs"]
    ((last,),) = store.client.query("SELECT max(Timestamp) FROM otel_traces").result_rows
    now = last.replace(tzinfo=timezone.utc) + timedelta(seconds=1)
    sql = expand(rule.sql, QueryContext(now - timedelta(seconds=rule.window_s), now, interval_ms=1000))
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    names, rows = [c["name"] for c in result["meta"]], result["data"]
    assert names[-1] == "deviating" and rows == [], rows


# -- (8) heterogeneous fleets: an identity is where, a setting is why
H200 = {"gpu.model": "NVIDIA H200", "gpu.driver.version": "570.133.20", "engine.attention_backend": "FLASH_ATTN"}


def _fleet_of_four(store, resources: dict[str, dict], deviating: str = "c") -> tuple[str, dict, dict]:
    """Hosts a..d with these resource attributes (the configuration detector's), every request served twice a
    minute per prompt for six minutes; ``deviating``'s decode outputs differ. (a deviating request ID, its explain
    report, its divergences entry). The live analyser's row for the request says the same as both (one analysis,
    three views)."""
    fleet_ = fleet.Fleet(store, resources={h: {**H200, **resources.get(h, {})} for h in "abcd"})
    n = 0
    for minute in range(6):
        for host in "abcd":
            for prompt in range(2):
                fleet_.request(
                    f"r{n}",
                    fleet_.at(minute, seconds=n % 50),
                    host,
                    prompt=prompt,
                    differs={"decode": "x"} if host == deviating else None,
                )
                n += 1
    fleet_.flush()
    bad = [r for r, v in fleet_.requests.items() if v["host"] == deviating][3]
    report = checked(Explainer(store).explain(bad).to_json())
    found = divergences.find(store, 6 * 3600 * SECOND, limit=0)
    entry = next(item for group in found["groups"] for item in group["deviating"] if item["request_id"] == bad)
    live.Analyser(store, live.Schedule(settle_s=0, lookback_s=3 * 3600)).step()
    ((stage, cause),) = store.client.query(
        "SELECT FirstDivergentStage, TopCauseName FROM {db:Identifier}.stagetrace_divergences FINAL "
        "WHERE RequestId = {r:String}",
        parameters={"db": store.database, "r": bad},
    ).result_rows
    assert (
        (stage, cause)
        == (entry["first_divergent_stage"], entry["top_cause"]["name"])
        == (report["first_divergent_stage"], report["causes"][0]["name"])
    )
    return bad, report, entry


@pytest.mark.parametrize(
    "name, resources, cause, value, where",
    [
        ("another GPU model", {"c": {"gpu.model": "NVIDIA H100 80GB HBM3"}}, "gpu.model", "NVIDIA H100 80GB HBM3", "c"),
        ("another driver", {"c": {"gpu.driver.version": "550.54.15"}}, "gpu.driver.version", "550.54.15", "c"),
        (
            "an engine setting",
            {"c": {"engine.attention_backend": "FLASHINFER"}},
            "engine.attention_backend",
            "FLASHINFER",
            "c",
        ),
        ("present on one host only", {"c": {"env.NCCL_ALGO": "Tree"}}, "env.NCCL_ALGO", "Tree", "c"),
        (
            "a harmless difference elsewhere",
            {"b": {"gpu.model": "NVIDIA H100 80GB HBM3"}, "c": {"engine.attention_backend": "FLASHINFER"}},
            "engine.attention_backend",
            "FLASHINFER",
            "c",
        ),
    ],
)
def test_the_setting_is_the_cause_and_the_host_is_where(store, name, resources, cause, value, where):
    _, report, entry = _fleet_of_four(store, resources)
    top = report["causes"][0]
    assert (report["first_divergent_stage"], top["name"], top["value"]) == ("decode", cause, value), report["causes"]
    assert top["where"]["host.name"] == where
    assert f"{where} runs {cause} {value} where its peers run" in report["summary"]
    assert f"known: {conventions.KNOWN_CAUSES[cause]}" in report["summary"]  # what the engines document about it
    assert (entry["first_divergent_stage"], entry["top_cause"]["name"]) == ("decode", cause)  # one analysis
    identities = [c for c in report["causes"] if c["name"] in ("host.name", "gpu.uuid")]
    assert identities and all(report["causes"].index(c) > 0 for c in identities)


def test_settings_that_changed_together_are_one_candidate_that_says_so(store):
    _, report, entry = _fleet_of_four(
        store, {"c": {"engine.attention_backend": "FLASHINFER", "engine.kv_cache_dtype": "fp8"}}
    )
    top = report["causes"][0]
    names = {top["name"], *(c["name"] for c in top["together"])}
    assert names == {"engine.attention_backend", "engine.kv_cache_dtype"}
    assert "changed together on c and cannot be told apart here" in report["summary"]
    assert entry["top_cause"]["name"] == top["name"]


def test_an_identity_with_nothing_else_recorded_stays_the_cause(store):
    _, report, entry = _fleet_of_four(store, {})
    top = report["causes"][0]
    assert (
        top["name"] in ("gpu.uuid", "host.name") and not top["weak"] and "GPU-c-0" in report["summary"] + top["value"]
    )
    assert entry["top_cause"]["name"] == top["name"]


def test_a_setting_documented_not_to_change_numerics_is_never_blamed(store):
    """Host c logs NCCL at INFO and serves an engine port of its own, and its outputs deviate for another reason
    nothing recorded: the logging and the port are named as neutral, never as the cause; the identity stays it."""
    _, report, entry = _fleet_of_four(store, {"c": {"env.NCCL_DEBUG": "INFO", "engine.port": "8001"}})
    top = report["causes"][0]
    assert top["name"] in ("gpu.uuid", "host.name") and not top["weak"], report["causes"]
    neutral = {c["name"]: c for c in report["causes"] if c["name"] in ("env.NCCL_DEBUG", "engine.port")}
    assert set(neutral) == {"env.NCCL_DEBUG", "engine.port"}
    assert all(c["weak"] and c["neutral"] == conventions.NUMERICS_NEUTRAL[n] for n, c in neutral.items())
    assert "NCCL_DEBUG" not in report["summary"] and entry["top_cause"]["name"] == top["name"]


def test_differences_no_contrast_weighed_say_nothing_of_where_or_together():
    """Without a population to weigh them (no other request carried either value), every difference scores the
    same: that is no evidence that settings changed together, nor that an identity is only where."""
    from stagetrace.analysis.causes import UNSCORED, Cause, ranked

    found = ranked(
        [
            Cause("attribute", "decode", name, value, "", UNSCORED, {"role": "setting"})
            for name, value in (("engine.kv_cache_dtype", "fp8"), ("engine.max_num_seqs", "64"), ("host.name", "c"))
        ]
    )
    assert [c.name for c in found] == ["engine.kv_cache_dtype", "engine.max_num_seqs", "host.name"]
    assert not any("together" in c.evidence or "where" in c.evidence for c in found)


# -- (9) a request that skipped a stage its peers ran
def test_a_request_that_skipped_a_stage_is_compared_by_its_root_in_explain_and_divergences(store):
    """Class: a request-level flag on the root span makes some requests bypass a stage (the cache) and their outputs
    differ. The divergence is at the stage the baseline ran and the request did not; the cause is what the root span
    says differently, found alike by ``explain`` and by ``divergences`` (which compares stage spans only, and reads
    such a request's trace whole). One host, so that nothing but the flag differs from the baseline."""
    fl = fleet.Fleet(store)
    bypassed = []
    for minute in range(6):
        for k in range(4):
            skip = minute == 5 and k < 2
            r = fl.request(
                f"r-{minute}-{k}",
                fl.at(minute, seconds=10 * k),
                "node-1",
                skip=("cache",) if skip else (),
                root={"request.cache_mode": "bypass" if skip else "use"},
            )
            if skip:
                bypassed.append(r["request_id"])
    fl.flush()

    report = explain(store, bypassed[-1])
    assert report["first_divergent_stage"] == "cache", report["summary"]
    assert verdict(top(report))[2:] == ("request.cache_mode", "bypass", "use"), report["causes"][:3]
    items = deviating(find(store, fl))
    assert sorted(items) == sorted(bypassed)
    for request_id in bypassed:
        assert items[request_id]["first_divergent_stage"] == "cache"
        assert items[request_id]["top_cause"]["name"] == "request.cache_mode", items[request_id]["summary"]
        assert items[request_id]["service"] == fleet.SERVICE
