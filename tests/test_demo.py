"""``stagetrace demo``: ground truth checked against what the store recorded, and the numbers that make it credible.

The demo runs once (module fixture) through the real CLI into a real embedded store; the tests read
the spans, metric samples and truth table back with SQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from collections import Counter, defaultdict

import numpy as np
import pytest

from stagetrace.demo import faults, world
from stagetrace.demo.pipeline import DocCache
from stagetrace.store import open_store

REQUESTS, NODES, SEED = 600, 4, 11


def _demo(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagetrace", "demo", *args], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dsn = f"chdb://{tmp_path_factory.mktemp('demo') / 'store'}"
    done = _demo("--requests", str(REQUESTS), "--nodes", str(NODES), "--seed", str(SEED), "--json", "--store", dsn)
    assert done.returncode == 0, done.stderr
    return dsn, json.loads(done.stdout)


@pytest.fixture(scope="module")
def recorded(run):
    """Per request: host, input and output digests, and each stage's (input digest, output digest, attributes)."""
    dsn, _ = run
    with open_store(dsn) as store:
        requests = store.client.query(
            "SELECT RequestId, TraceId, HostName, InputDigest, OutputDigest FROM {db:Identifier}.stagetrace_requests",
            parameters={"db": store.database},
        ).result_rows
        stages = store.client.query(
            """SELECT TraceId, SpanAttributes['stagetrace.stage'], SpanAttributes['stagetrace.stage.input_digest'],
                      SpanAttributes['stagetrace.stage.output_digest'], SpanAttributes
               FROM {db:Identifier}.otel_traces WHERE mapContains(SpanAttributes, 'stagetrace.stage')""",
            parameters={"db": store.database},
        ).result_rows
        truth = store.client.query("SELECT RequestId, Stage, Cause FROM {db:Identifier}.stagetrace_demo_truth",
                                   parameters={"db": store.database}).result_rows  # fmt: skip
        metrics = store.client.query(
            """SELECT ResourceAttributes['host.name'], MetricName, Attributes, max(Value) - min(Value), max(Value)
               FROM {db:Identifier}.otel_metrics_sum GROUP BY 1, 2, 3""",
            parameters={"db": store.database},
        ).result_rows
    by_trace = defaultdict(dict)
    for trace_id, stage, din, dout, attrs in stages:
        by_trace[trace_id][stage] = (din, dout, attrs)
    out = {rid: {"host": host, "input": din, "output": dout, "stages": by_trace[tid]}
           for rid, tid, host, din, dout in requests}  # fmt: skip
    return out, truth, metrics


def _majority(values) -> str:
    return Counter(values).most_common(1)[0][0]


def test_every_request_is_recorded_with_five_stages(run, recorded):
    requests, _, _ = recorded
    assert len(requests) == REQUESTS == run[1]["requests"]
    assert all(set(r["stages"]) == set(world_stages()) for r in requests.values())
    inputs = Counter(r["input"] for r in requests.values())
    assert min(inputs.values()) >= 5, "inputs repeat, so deviating outputs are visible"


def world_stages():
    return ("retrieval", "cache", "context_assembly", "allreduce", "decode")


def test_ground_truth_matches_what_was_recorded(run, recorded):
    """Each fault changed the output digest of the stage it claims, whose input digest was the majority's."""
    requests, truth_rows, _ = recorded
    doc = run[1]
    truth = {t["request_id"]: (t["stage"], t["cause"]) for t in doc["truth"]}
    assert truth == {rid: (stage, cause) for rid, stage, cause in truth_rows}
    groups = defaultdict(list)
    for r in requests.values():
        groups[r["input"]].append(r)
    for rid, (stage, cause) in truth.items():
        assert cause in faults.CAUSES[stage].values()
        peers = groups[requests[rid]["input"]]
        din, dout, _ = requests[rid]["stages"][stage]
        assert din == _majority(p["stages"][stage][0] for p in peers), f"{rid}: input of {stage} already differed"
        assert dout != _majority(p["stages"][stage][1] for p in peers), f"{rid}: {stage} output did not change"
    for rid, r in requests.items():
        majority = _majority(p["output"] for p in groups[r["input"]])
        assert (r["output"] != majority) == (rid in truth), f"{rid}: a request without a fault must have the majority output"
    assert sorted(doc["deviating"]) == sorted(truth)
    assert {cause for _, cause in truth.values()} == {c for stage in faults.CAUSES.values() for c in stage.values()}


def test_ring_and_tree_sums_differ_in_float32_for_the_demo_sizes():
    model = world.Model(SEED)
    differing = 0
    for spec in world.prompts(SEED, 50):
        x = model.context_vector(spec["prompt"])
        partials = [model.partial(rank, x) for rank in range(world.TP_SIZE)]
        ring, tree = world.ring_order(partials), world.tree_order(partials)
        assert np.allclose(ring, tree, rtol=1e-4, atol=1e-5), "the same sum up to rounding"
        differing += not np.array_equal(ring, tree)
    assert differing >= 45, f"ring and tree differ in the low bits for only {differing} of 50 contexts"


def test_batch_size_chunking_flips_tokens_in_the_run(run, recorded):
    requests, _, _ = recorded
    flipped = [t["request_id"] for t in run[1]["truth"] if t["cause"] == "decode.batch_size"]
    assert flipped, "no co-batched request had its tokens changed"
    for rid in flipped:
        assert int(requests[rid]["stages"]["decode"][2]["decode.batch_size"]) > 8  # outside the batch-invariant range
    model = world.Model(SEED)
    h0 = model.partial(0, model.context_vector("a b c"))
    assert model.decode(h0, world.split_k_chunks(4)) == model.decode(h0, world.split_k_chunks(8))
    assert model.decode(h0, world.split_k_chunks(4)) != model.decode(h0, world.split_k_chunks(24))


def test_truncation_happens_only_on_the_small_context_node(recorded):
    requests, _, _ = recorded
    small = {c.host for c in faults.plan(NODES) if c.small_context_from is not None}
    truncated_on = {r["host"] for r in requests.values() if r["stages"]["context_assembly"][2]["context.truncated"] == "true"}
    assert truncated_on == small


def test_hardware_faults_show_in_the_collected_counters(recorded):
    """The simulated NIC and GPUs are read by the real rdma and gpu collectors."""
    _, _, metrics = recorded
    plan = faults.plan(NODES)
    rose = defaultdict(set)
    for host, name, attrs, increase, highest in metrics:
        if increase > 0 or name == "gpu_xid_errors_total" and highest > 0:  # an XID series starts at its first event
            rose[name].add((host, attrs.get("xid", "")))
    assert {h for h, _ in rose["rdma_local_ack_timeout_err_total"]} == {c.host for c in plan if c.nic_timeouts}
    assert rose["gpu_xid_errors_total"] == {(c.host, "48") for c in plan if c.xid_at is not None}
    assert {h for h, _ in rose["rdma_port_transmit_bytes_total"]} == {c.host for c in plan}


def test_same_seed_same_run(tmp_path):
    first = _demo("--requests", "40", "--nodes", "2", "--seed", "3", "--json", "--store", f"chdb://{tmp_path / 'a'}")
    second = _demo("--requests", "40", "--nodes", "2", "--seed", "3", "--json", "--store", f"chdb://{tmp_path / 'b'}")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout)


def test_unversioned_cache_keys_serve_stale_documents_after_a_rebuild():
    indexes = world.corpora(SEED)
    old, new = indexes[world.OLD_INDEX], indexes[world.NEW_INDEX]
    edited = next(i for i, d in new.docs.items() if i in old.docs and d.revision != old.docs[i].revision)
    for key_has_version, served in ((True, new.docs[edited].text), (False, old.docs[edited].text)):
        cache = DocCache(capacity=8, ttl_s=60, key_has_version=key_has_version)
        cache.fetch(edited, old, now=0)
        text, version, age = cache.fetch(edited, new, now=10)
        assert text == served
    assert (version, age) == (world.OLD_INDEX, 10), "the stale entry says when and under which index it was made"
    assert cache.fetch(edited, new, now=100)[0] == new.docs[edited].text, "expired entries are fetched again"


@pytest.mark.parametrize("args, message", [(["--nodes", "1"], "use 2 to 16 nodes"), (["--requests", "5"], "at least 20")])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    done = _demo(*args, "--store", f"chdb://{tmp_path / 's'}")
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_default_run_prints_next_commands_that_work_when_pasted(tmp_path):
    """The README's first command: ``stagetrace demo`` with defaults into the default embedded store."""
    bin_dir = Path(sys.executable).parent
    env = {"XDG_DATA_HOME": str(tmp_path), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    done = subprocess.run([str(bin_dir / "stagetrace"), "demo"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "stagetrace" / "store").is_dir()
    assert "served 1000 requests" in done.stdout
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("  ") and "stagetrace " in line]
    assert sum(" trace req-" in c for c in commands) == sum(" explain req-" in c for c in commands) == 3
    assert any(c.endswith(" divergences") for c in commands)
    for command in commands:
        pasted = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=120)
        assert pasted.returncode == 0, f"{command}: {pasted.stderr}"
        assert "diverged" in pasted.stdout if " explain " in command else True
        assert "retrieval" in pasted.stdout and "decode" in pasted.stdout if " trace " in command else True
