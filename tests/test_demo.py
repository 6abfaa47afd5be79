"""``stagetrace demo``: ground truth checked against what the store recorded, and the numbers that make it credible.

The demo runs once (module fixture) through the real CLI into a real embedded store; the tests read
the spans, metric samples and truth table back with SQL. These tests are of the pipeline (its service, its
hosts); the fabric and weights half hour the demo also plays has tests of its own (``test_fabric_demo``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from stagetrace import demo
from stagetrace.demo import faults, hardware, world
from stagetrace.demo.pipeline import REMOTE_RANKS, SERVICE_NAME, DocCache
from stagetrace.digest import digest
from stagetrace.store import open_store

REQUESTS, NODES, SEED = 600, 4, 11
PIPELINE = {"service": SERVICE_NAME}  # query parameter: the pipeline's rows, not the fabric scenario's
PIPELINE_HOST = "match(ResourceAttributes['host.name'], '^gpu-node-[0-9]+$')"
GETTING_STARTED = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"


def _demo(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", "demo", *args], capture_output=True, text=True, timeout=300, env=env
    )


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
            "SELECT RequestId, TraceId, HostName, InputDigest, OutputDigest FROM {db:Identifier}.stagetrace_requests "
            "WHERE ServiceName = {service:String}",
            parameters={"db": store.database, **PIPELINE},
        ).result_rows
        stages = store.client.query(
            """SELECT TraceId, SpanAttributes['stagetrace.stage'], SpanAttributes['stagetrace.stage.input_digest'],
                      SpanAttributes['stagetrace.stage.output_digest'], SpanAttributes
               FROM {db:Identifier}.otel_traces WHERE mapContains(SpanAttributes, 'stagetrace.stage')
               AND ServiceName = {service:String}""",
            parameters={"db": store.database, **PIPELINE},
        ).result_rows
        truth = store.client.query(
            "SELECT RequestId, Stage, Cause, Expected, Nondeterministic FROM {db:Identifier}.stagetrace_demo_truth",
            parameters={"db": store.database},
        ).result_rows
        metrics = store.client.query(
            f"""SELECT ResourceAttributes['host.name'], MetricName, Attributes, max(Value) - min(Value), max(Value)
               FROM {{db:Identifier}}.otel_metrics_sum WHERE {PIPELINE_HOST} GROUP BY 1, 2, 3""",
            parameters={"db": store.database},
        ).result_rows
    by_trace = defaultdict(dict)
    for trace_id, stage, din, dout, attrs in stages:
        by_trace[trace_id][stage] = (din, dout, attrs)
    out = {
        rid: {"host": host, "input": din, "output": dout, "stages": by_trace[tid]}
        for rid, tid, host, din, dout in requests
    }
    return out, truth, metrics


def _majority(values) -> str:
    return Counter(values).most_common(1)[0][0]


_OTHER = {
    world.OLD_INDEX: world.NEW_INDEX,
    world.NEW_INDEX: world.OLD_INDEX,
    faults.OLD_TEMPLATE: faults.NEW_TEMPLATE,
    faults.NEW_TEMPLATE: faults.OLD_TEMPLATE,
}


def _epoch(request: dict, truth: dict | None, own: bool = False) -> tuple[str, str]:
    """The index and template the fleet ran when the request was served (``own``: those its host ran).

    A truth row on a rolled-out setting says the host ran another value than most hosts."""
    index = request["stages"]["retrieval"][2]["retrieval.index.version"]
    template = request["stages"]["context_assembly"][2]["context.template.version"]
    if truth and not own and truth["cause"] == "retrieval.index.version":
        index = _OTHER[index]
    if truth and not own and truth["cause"] == "context.template.version":
        template = _OTHER[template]
    return index, template


def test_every_request_is_recorded_with_five_stages(run, recorded):
    requests, _, _ = recorded
    assert len(requests) == REQUESTS == run[1]["requests"]
    assert all(set(r["stages"]) == set(world_stages()) for r in requests.values())
    inputs = Counter(r["input"] for r in requests.values())
    assert min(inputs.values()) >= 5, "inputs repeat, so deviating outputs are visible"


def world_stages():
    return ("retrieval", "cache", "context_assembly", "allreduce", "decode")


def test_ground_truth_matches_what_was_recorded(run, recorded):
    """Each fault changed the output digest of the stage it claims, whose input digest was the majority's.

    The peers of a request are the requests with the same input served while the fleet ran the same index
    and template; expected changes and requests sampled without a seed are nobody's peers."""
    requests, truth_rows, _ = recorded
    doc = run[1]
    truth = {t["request_id"]: t for t in doc["truth"]}
    assert {rid: (t["stage"], t["cause"], t["expected"], t["nondeterministic"]) for rid, t in truth.items()} == {
        rid: (stage, cause, bool(expected), bool(nondeterministic))
        for rid, stage, cause, expected, nondeterministic in truth_rows
    }
    compared = {
        rid: r
        for rid, r in requests.items()
        if not (rid in truth and (truth[rid]["expected"] or truth[rid]["nondeterministic"]))
    }
    groups = defaultdict(list)
    for rid, r in compared.items():
        groups[(r["input"], _epoch(r, truth.get(rid)))].append(r)
    for rid, t in truth.items():
        if t["nondeterministic"]:
            continue
        stage = t["stage"]
        assert t["cause"] in faults.CAUSES[stage].values()
        peers = groups[(requests[rid]["input"], _epoch(requests[rid], t))]
        din, dout, _ = requests[rid]["stages"][stage]
        assert din == _majority(p["stages"][stage][0] for p in peers), f"{rid}: input of {stage} already differed"
        assert dout != _majority(p["stages"][stage][1] for p in peers), f"{rid}: {stage} output did not change"
    for rid, r in compared.items():
        majority = _majority(p["output"] for p in groups[(r["input"], _epoch(r, truth.get(rid)))])
        assert (r["output"] != majority) == (rid in truth), (
            f"{rid}: a request without a fault must have the majority output"
        )
    deviations = {rid for rid, t in truth.items() if not (t["expected"] or t["nondeterministic"])}
    assert sorted(doc["deviating"]) == sorted(deviations)
    assert {truth[rid]["cause"] for rid in deviations} == {
        cause
        for stage in faults.CAUSES.values()
        for fault, cause in stage.items()
        if fault not in faults.EXPECTED | faults.NONDETERMINISTIC and cause != "context.template.version"
    }


def test_rollout_and_unseeded_truth_rows_say_so(run, recorded):
    """The template's rollout wave gives expected changes, the seedless tenant nondeterministic requests;
    neither is a deviation, and an expected change's output is the one its template gives elsewhere."""
    requests, _, _ = recorded
    truth = {t["request_id"]: t for t in run[1]["truth"]}
    assert all(isinstance(t["expected"], bool) and isinstance(t["nondeterministic"], bool) for t in truth.values())
    assert not any(t["expected"] and t["nondeterministic"] for t in truth.values())
    expected = {rid: t for rid, t in truth.items() if t["expected"]}
    assert {(t["stage"], t["cause"]) for t in expected.values()} <= {
        ("context_assembly", "context.template.version"),
        ("retrieval", "retrieval.index.version"),
    }
    assert any(t["cause"] == "context.template.version" for t in expected.values()), (
        "the rollout wave left expected changes"
    )
    same_template = defaultdict(list)
    for rid, r in requests.items():
        if rid not in truth:
            same_template[(r["input"], _epoch(r, None, own=True))].append(r["output"])
    for rid, t in expected.items():
        if (
            t["cause"] == "context.template.version"
            and same_template[(requests[rid]["input"], _epoch(requests[rid], t, own=True))]
        ):
            assert requests[rid]["output"] == _majority(
                same_template[(requests[rid]["input"], _epoch(requests[rid], t, own=True))]
            )
    nondeterministic = {rid for rid, t in truth.items() if t["nondeterministic"]}
    assert {(truth[rid]["stage"], truth[rid]["cause"]) for rid in nondeterministic} == {("decode", "nondeterministic")}
    unseeded_inputs = {digest(p) for p in world.prompts(SEED, max(4, REQUESTS // 40)) if world.unseeded(p)}
    assert unseeded_inputs and nondeterministic == {rid for rid, r in requests.items() if r["input"] in unseeded_inputs}
    outputs = Counter(requests[rid]["output"] for rid in nondeterministic)
    assert outputs.most_common(1)[0][1] == 1, "sampled without a seed, every output differs"
    assert not nondeterministic & set(run[1]["deviating"]) and not set(expected) & set(run[1]["deviating"])


def test_seedless_requests_record_a_temperature_and_no_seed(run):
    dsn, _ = run
    with open_store(dsn) as store:
        rows = store.client.query(
            """SELECT SpanAttributes['gen_ai.request.temperature'], mapContains(SpanAttributes, 'gen_ai.request.seed'), count()
               FROM {db:Identifier}.otel_traces WHERE SpanName = 'inference.request' GROUP BY 1, 2""",
            parameters={"db": store.database},
        ).result_rows
    assert {(temperature, seeded) for temperature, seeded, _ in rows} == {
        ("0.0", True),
        (str(world.UNSEEDED_TEMPERATURE), False),
    }


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
    truncated_on = {
        r["host"] for r in requests.values() if r["stages"]["context_assembly"][2]["context.truncated"] == "true"
    }
    assert truncated_on == small


def test_hardware_faults_show_in_the_collected_counters(recorded):
    """The simulated NIC and GPUs are read by the real rdma and gpu collectors, the remote TP host's too."""
    _, _, metrics = recorded
    plan = faults.plan(NODES)
    rose = defaultdict(set)
    for host, name, attrs, increase, highest in metrics:
        if increase > 0 or name == "gpu_xid_errors_total" and highest > 0:  # an XID series starts at its first event
            rose[name].add((host, attrs.get("xid", "")))
    assert {h for h, _ in rose["rdma_local_ack_timeout_err_total"]} == {c.host for c in plan if c.nic_timeouts}
    assert rose["gpu_xid_errors_total"] == {(c.host, "48") for c in plan if c.xid_at is not None}
    remote = {c.tp_remote_host for c in plan if c.tp_remote_host}
    assert remote == {faults.remote_host(NODES)} and not remote & {c.host for c in plan}
    assert {h for h, _ in rose["rdma_port_transmit_bytes_total"]} == {c.host for c in plan} | remote
    assert {h for h, _ in rose["rdma_out_of_sequence_total"]} == remote
    for name in ("rdma_packet_seq_err_total", "rdma_implied_nak_seq_err_total"):
        assert not rose[name], f"{name} rose: the sequence-error fault raises one counter"


TENANTS_SQL = """
SELECT ResourceAttributes['host.name'], Attributes['uuid'], Attributes['namespace'], Attributes['pod'], max(Value)
FROM {db:Identifier}.otel_metrics_gauge
WHERE MetricName = 'gpu_tenant_memory_used_bytes' GROUP BY 1, 2, 3, 4"""


def test_the_mps_shared_gpu_shows_both_tenants_and_the_mps_server(run):
    """The node that shares a GPU through MPS: the gpu collector names each client process's pod from the host's
    procfs and the kubelet's log directory, as on a real node, and the pods' memory is counted once each."""
    dsn, _ = run
    with open_store(dsn) as store:
        rows = store.client.query(TENANTS_SQL, parameters={"db": store.database}).result_rows
    by_gpu = defaultdict(dict)
    for host, uuid, namespace, pod, memory in rows:
        by_gpu[(host, uuid)][(namespace, pod)] = memory
    (shared_host, _), tenants = next((gpu, t) for gpu, t in by_gpu.items() if len(t) > 1)
    sharing = {(namespace, pod) for namespace, pod, _ in hardware.SHARING_PODS}
    assert set(tenants) == sharing | {("kube-system", f"nvidia-device-plugin-{shared_host}")}
    assert all(tenants[pod] > 2**30 for pod in sharing)  # each client's own memory, not the device's
    assert sum(len(t) > 1 for t in by_gpu.values()) == 1  # one GPU shared, on one host


def test_a_tp_group_across_two_hosts_records_one_allreduce_span_per_rank(run):
    """Ranks 0-1 on the node's host, 2-3 under the remote host's resource, each with its own host's NIC."""
    dsn, _ = run
    (node,) = [c for c in faults.plan(NODES) if c.tp_remote_host]
    with open_store(dsn) as store:
        rows = store.client.query(
            """SELECT TraceId, ResourceAttributes['host.name'], SpanAttributes['parallel.tp_rank'],
                      SpanAttributes['net.rdma.devices'], SpanAttributes['stagetrace.stage.input_digest'],
                      SpanAttributes['stagetrace.stage.output_digest']
               FROM {db:Identifier}.otel_traces WHERE SpanAttributes['stagetrace.stage'] = 'allreduce'
               AND ServiceName = {service:String}""",
            parameters={"db": store.database, **PIPELINE},
        ).result_rows
        hosts = dict(
            store.client.query(
                "SELECT TraceId, HostName FROM {db:Identifier}.stagetrace_requests "
                "WHERE ServiceName = {service:String}",
                parameters={"db": store.database, **PIPELINE},
            ).result_rows
        )
    by_trace = defaultdict(list)
    for trace_id, *span in rows:
        by_trace[trace_id].append(span)
    assert set(hosts) == set(by_trace)
    for trace_id, spans in by_trace.items():
        if hosts[trace_id] != node.host:
            assert [(s[0], s[1]) for s in spans] == [(hosts[trace_id], "")], "one span for a single-host group"
            continue
        ranks = {rank: (host, devices, din, dout) for host, rank, devices, din, dout in spans}
        assert len(spans) == len(ranks) == world.TP_SIZE and set(ranks) == {str(r) for r in range(world.TP_SIZE)}
        for rank, (host, devices, din, dout) in ranks.items():
            assert host == (node.tp_remote_host if int(rank) in REMOTE_RANKS else node.host)
            assert devices == '["mlx5_0"]'
        assert len({(din, dout) for _, _, din, dout in ranks.values()}) == 1, "every rank has the group's input and sum"


def test_decode_spans_name_the_weight_step(run, recorded):
    requests, _, _ = recorded
    truth = {t["request_id"]: t for t in run[1]["truth"]}
    (node,) = [c for c in faults.plan(NODES) if c.restarted_weights_from is not None]
    steps = Counter((r["host"], r["stages"]["decode"][2]["model.weights.step"]) for r in requests.values())
    assert {step for _, step in steps} == {str(world.FLEET_WEIGHTS_STEP), str(faults.RESTARTED_WEIGHTS_STEP)}
    assert {host for host, step in steps if step == str(faults.RESTARTED_WEIGHTS_STEP)} == {node.host}
    assert not any("model.weights.digest" in r["stages"]["decode"][2] for r in requests.values())
    stale = [rid for rid, t in truth.items() if t["cause"] == "model.weights.step"]
    assert stale and all(
        requests[rid]["stages"]["decode"][2]["model.weights.step"] == str(faults.RESTARTED_WEIGHTS_STEP)
        for rid in stale
    )


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 8, 16])
def test_hosts_off_the_fleets_template_have_no_fault_of_their_own(nodes):
    """During the template's wave a host that runs another template than most hosts is an expected change;
    for the ground truth to stay unambiguous no fault of its own is active then, as planned and as the
    requests of a run show the wave (a host switches with its first request after its moment)."""
    planned = faults.plan(nodes)
    cases = [(cfg, [step / 1000 for step in range(1000)]) for cfg in planned]
    for seed in (1, 2, 3, 4, 5, SEED) if nodes <= 8 else ():  # on more nodes each serves too few requests of 800
        served = {node: [s.position for s in specs] for node, specs in demo.request_specs(800, nodes, seed).items()}
        cases += [(cfg, served.get(cfg.index, [])) for cfg in faults.observed(planned, served)]
    for cfg, positions in cases:
        for position in positions:
            if cfg.template(position) == cfg.fleet_template(position):
                continue
            assert cfg.template_change(position) == "expected", (cfg.host, position)
            assert cfg.max_context_tokens(position) == faults.REFERENCE_CONTEXT_TOKENS, (cfg.host, position)
            assert cfg.index_change(position) is None and cfg.algorithm(position) == "ring", (cfg.host, position)
            assert not cfg.in_burst(position) and not cfg.in_seq_error_window(position), (cfg.host, position)
            assert cfg.weights_step(position) == world.FLEET_WEIGHTS_STEP, (cfg.host, position)
            assert cfg.nic_timeouts is None or not cfg.nic_timeouts[0] <= position < cfg.nic_timeouts[1], (
                cfg.host,
                position,
            )
            assert cfg.xid_at is None or not cfg.xid_at <= position < cfg.xid_at + 0.05, (cfg.host, position)


def test_same_seed_same_run(tmp_path):
    first = _demo("--requests", "40", "--nodes", "2", "--seed", "3", "--json", "--store", f"chdb://{tmp_path / 'a'}")
    second = _demo("--requests", "40", "--nodes", "2", "--seed", "3", "--json", "--store", f"chdb://{tmp_path / 'b'}")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout)


def _timeline(dsn: str) -> tuple[list, list]:
    """What a machine's speed could change in a run's store: when each request started (from the run's first) and
    the truth table's rows (without the ID of the run that wrote them, which is each run's own)."""
    with open_store(dsn) as store:
        starts = store.client.query(
            "SELECT RequestId, toUnixTimestamp64Nano(Start) - toUnixTimestamp64Nano(min(Start) OVER ()) "
            "FROM {db:Identifier}.stagetrace_requests WHERE ServiceName = {service:String} ORDER BY RequestId",
            parameters={"db": store.database, **PIPELINE},
        ).result_rows
        truth = store.client.query(
            f"SELECT * EXCEPT Run FROM {{db:Identifier}}.{demo.TRUTH_TABLE} ORDER BY RequestId",
            parameters={"db": store.database},
        ).result_rows
    return starts, truth


def test_same_seed_same_run_under_load(tmp_path):
    """The default run twice with its seed, once beside processes that keep the cores busy: the same deviating
    outputs, the same truth, and every request at the same moment of the run. On the wall clock, load moved a
    request near a rollout wave's end to the other side of it (five runs of seed 7 gave 143 to 146 deviating
    outputs); the demo's spans and samples lie on its simulated clock (``pipeline.SimClock``)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(os.cpu_count() or 1, 4))]
    try:
        loaded = _demo("--json", "--store", f"chdb://{tmp_path / 'loaded'}")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    idle = _demo("--json", "--store", f"chdb://{tmp_path / 'idle'}")
    assert loaded.returncode == idle.returncode == 0, loaded.stderr + idle.stderr
    first, second = json.loads(loaded.stdout), json.loads(idle.stdout)
    assert first["requests"] == 1000 and len(first["deviating"]) > 100
    assert any(t["expected"] and t["cause"] == "retrieval.index.version" for t in first["truth"]), (
        "the lagging host's requests near the index wave's end, which load used to move, are in the run"
    )
    assert first["deviating"] == second["deviating"]
    assert first["truth"] == second["truth"]
    assert _timeline(f"chdb://{tmp_path / 'loaded'}") == _timeline(f"chdb://{tmp_path / 'idle'}")


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


@pytest.mark.parametrize(
    "args, message", [(["--nodes", "1"], "use 2 to 16 nodes"), (["--requests", "5"], "at least 20")]
)
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
    # the docs' figure for this run is what it prints
    low, high = map(
        int,
        re.search(r"With the defaults, about (\d+)–(\d+)% of requests deviate", GETTING_STARTED.read_text()).groups(),
    )
    deviating = int(re.search(r"deviating outputs: (\d+)", done.stdout)[1])
    assert low <= deviating / 10 <= high
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("  ") and "stagetrace " in line]
    assert sum(" trace req-" in c for c in commands) == sum(" explain req-" in c for c in commands) == 3
    assert any(c.endswith(" divergences") for c in commands)
    for command in commands:
        pasted = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=120)
        assert pasted.returncode == 0, f"{command}: {pasted.stderr}"
        assert "diverged" in pasted.stdout if " explain " in command else True
        assert "retrieval" in pasted.stdout and "decode" in pasted.stdout if " trace " in command else True


def _started(dsn: str) -> str:
    with open_store(dsn) as store:
        return store.client.command(
            "SELECT formatDateTime(min(Started), '%Y-%m-%d %H:%i', 'UTC') FROM stagetrace.stagetrace_demo_runs"
        )


def test_a_second_run_into_the_same_store_is_refused_unless_fresh_or_appended(tmp_path):
    """Runs must not mix: the same seed gives the same request IDs, and counts would no longer agree."""
    dsn = f"chdb://{tmp_path / 'store'}"
    small = ("--requests", "40", "--nodes", "2", "--json", "--store", dsn)

    def requests() -> tuple[int, int]:
        with open_store(dsn) as store:
            return store.client.query(
                "SELECT count(), uniqExact(RequestId) FROM stagetrace.stagetrace_requests "
                "WHERE ServiceName = {service:String}",
                parameters=PIPELINE,
            ).result_rows[0]

    first = _demo(*small)
    assert first.returncode == 0, first.stderr
    again = _demo(*small)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().splitlines() == [
        f"stagetrace demo: the store {dsn} already holds a demo run of {_started(dsn)} UTC: add --fresh to remove "
        "it first (the demo's own spans, samples and ground truth; other services' data stays), or --append to add "
        "this run beside it"
    ]
    assert requests() == (40, 40)  # the refused run wrote nothing
    fresh = _demo(*small, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert requests() == (40, 40)
    assert json.loads(fresh.stdout)["truth"] == json.loads(first.stdout)["truth"]  # the same seed, alone again
    appended = _demo(*small, "--append")
    assert appended.returncode == 0, appended.stderr
    assert requests() == (80, 80)  # request IDs of its own


def test_the_summary_counts_add_up_and_name_what_is_no_deviation(tmp_path):
    """The table's rows are the deviating outputs by the fault behind each, and sum to the headline; the expected
    changes of the rollout and the requests sampled without a seed are counted apart, as what they are, and the
    first example to look up is a fault's."""
    dsn = f"chdb://{tmp_path / 'store'}"
    done = _demo("--store", dsn)  # the defaults: a rollout wave and the unseeded tenant both happen
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    headline = int(re.search(r"^deviating outputs: (\d+) ", done.stdout, re.M)[1])
    title = lines.index(f"# the {headline} deviating outputs by cause (ground truth: the injected fault)")
    assert lines[title + 1] == "cause\tstage\trequests\te.g."
    rows = [line.split("\t") for line in itertools.takewhile(lambda line: "\t" in line, lines[title + 2 :])]
    assert rows and sum(int(requests) for _, _, requests, _ in rows) == headline
    with open_store(dsn) as store:
        truth = {
            rid: (cause, bool(expected), bool(nondet))
            for rid, cause, expected, nondet in store.client.query(
                "SELECT RequestId, Cause, Expected, Nondeterministic FROM stagetrace.stagetrace_demo_truth"
            ).result_rows
        }
    for cause, _, _, example in rows:  # each row's example is a fault of that cause
        assert truth[example] == (cause, False, False)
    expected = Counter(cause for cause, e, _ in truth.values() if e)
    nondeterministic = sum(n for _, _, n in truth.values())
    assert expected and nondeterministic
    left_out = next(line for line in lines if line.startswith("not counted as deviating: "))
    for cause, n in expected.items():
        assert f"{n} expected changes while {cause} rolled out" in left_out
    assert f"{nondeterministic} nondeterministic requests (sampled without a seed" in left_out
    first = re.search(r"explain (req-[0-9a-f]+)", done.stdout)[1]
    assert first == rows[0][3] and truth[first][1:] == (False, False)
