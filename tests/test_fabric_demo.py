"""The fabric and weights the demo plays (``demo.fabric``), against its ground truth: rails, loss beside the
all-reduce, a TP host that drops out, weight syncs through one NIC and all to all, a GPU that misses a step.

The data is the demo's: sysfs trees, ethtool statistics and NCCL Inspector dumps in their real formats read by
the real collectors, spans from the OpenTelemetry SDK, all in a real embedded store. Dashboard panels and the
Grafana-managed rules run as Grafana sends them (``tests.grafana_macros.expand``); the Prometheus rules run under
Debian's promtool over the demo's own samples, written out as promtool input series with an ``up`` series that
is 0 where a host answered no scrape, as Prometheus records it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from stagetrace.dashboards import alert_rules, build_all
from tests.grafana_macros import ALL, QueryContext, Variable, expand
from stagetrace.demo import fabric

PROMETHEUS_RULES = Path(alert_rules.__file__).parent / "prometheus" / "hardware.rules.yml"
SCRAPE = timedelta(seconds=fabric.SCRAPE_S)
RULES = {rule.uid: rule for rule in alert_rules.RULES}
PANELS = {
    (uid, panel["title"]): panel["targets"][0]["rawSql"]
    for uid, dashboard in build_all().items()
    for panel in dashboard["panels"]
    if panel.get("targets")
}


def rows(store, sql: str, since: datetime, until: datetime, interval: timedelta = SCRAPE) -> list[dict]:
    variables = {"host": Variable((ALL,)), "service": Variable((ALL,))}
    sql = expand(sql, QueryContext(since, until, interval_ms=int(interval.total_seconds() * 1000)), variables)
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    names = [column["name"] for column in result["meta"]]
    return [dict(zip(names, row)) for row in result["data"]]


def at(text: str) -> datetime:
    """A DateTime as ClickHouse's JSON writes it, in UTC."""
    return datetime.fromisoformat(text[:26]).replace(tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def truth(demo_store) -> dict[str, list[dict]]:
    found = defaultdict(list)
    result = demo_store.client.query(
        f"SELECT Kind, Host, Device, Start, End, Step, Detail FROM {fabric.TRUTH_TABLE} ORDER BY Start, Host"
    )
    for kind, host, device, start, end, step, detail in result.result_rows:
        found[kind].append(
            {
                "host": host,
                "device": device,
                "start": start.replace(tzinfo=timezone.utc),
                "end": end.replace(tzinfo=timezone.utc),
                "step": step,
                "detail": detail,
            }
        )
    return found


@pytest.fixture(scope="module")
def span(truth) -> tuple[datetime, datetime]:
    """The scenario's half hour."""
    end = max(e["end"] for events in truth.values() for e in events)
    return end - timedelta(seconds=fabric.DURATION_S), end + timedelta(seconds=fabric.SYNC_EVERY_S)


def test_two_healthy_rails_carry_two_rails_and_the_slow_link_is_flagged(demo_store, truth, span):
    degraded = truth["rail_degraded"]
    assert {(e["host"], e["device"]) for e in degraded} == {(h, fabric.RAIL_DEVICES[1]) for h in fabric.TP_HOSTS}
    start, end = degraded[0]["start"], degraded[0]["end"]
    carried = rows(demo_store, PANELS[("stagetrace-fabric", "Rails carried")], span[0], start)
    healthy = [r["rails_carried"] for r in carried if r["host"] in fabric.TP_HOSTS and at(r["time"]) > span[0] + SCRAPE]
    assert len(healthy) > 20 and all(abs(value - 2.0) <= 0.02 for value in healthy)  # within 1% of 2.00

    below = rows(demo_store, PANELS[("stagetrace-fabric", "Rails below their peers")], *span)
    assert {(r["host"], r["port"]) for r in below} == {(e["host"], f"{e['host']} {e['device']}/1") for e in degraded}
    for r in below:  # seen slow from the scrape after it renegotiated to the last before it came back
        assert start <= at(r["since"]) + SCRAPE and at(r["since"]) <= start + SCRAPE
        assert end - 2 * SCRAPE <= at(r["last_below"]) < end
        assert (r["slowest"], r["expected"]) == (100e9 / 8, 400e9 / 8)


def test_loss_and_the_allreduce_time_rise_together_on_the_slow_rail(demo_store, truth, span):
    start, end = truth["rail_degraded"][0]["start"], truth["rail_degraded"][0]["end"]
    before, during = (span[0] + SCRAPE, start - SCRAPE), (start + SCRAPE, end - SCRAPE)
    allreduce = rows(demo_store, PANELS[("stagetrace-fabric", "All-reduce time per request")], *span)

    def p50(window) -> set[float]:
        return {r["p50"] for r in allreduce if window[0] <= at(r["time"]) < window[1]}

    assert p50(before) == {fabric.ALLREDUCE_MS} and p50(during) == {4 * fabric.ALLREDUCE_MS}
    loss = rows(demo_store, PANELS[("stagetrace-fabric", "Loss and retransmits")], *span)
    rose = {(r["port"], r["counter"]) for r in loss if r["rate"] > 0 and during[0] <= at(r["time"]) < during[1]}
    slow_rail = {f"{e['host']} {e['device']}/1" for e in truth["rail_degraded"]}
    assert {port for port, _ in rose} == slow_rail
    assert {counter for _, counter in rose} >= {
        "out_of_sequence",
        "packet_seq_err",
        "roce_adp_retrans",
        "symbol_errors",
    }
    assert not [r for r in loss if r["rate"] > 0 and before[0] <= at(r["time"]) < before[1]]


def test_a_tp_host_that_drops_out_degrades_its_group_within_two_scrapes(demo_store, truth):
    (down,) = truth["node_down"]
    rule = RULES["stagetrace-tp-group-degraded"]
    window = timedelta(seconds=rule.window_s)

    def evaluated(now: datetime) -> list[dict]:
        return [r for r in rows(demo_store, rule.sql, now - window, now) if r["service"] == fabric.TP_SERVICE]

    assert all(r["missing_ranks"] <= rule.threshold for r in evaluated(down["start"] - timedelta(seconds=1)))
    degraded = evaluated(down["start"] + 2 * SCRAPE)
    assert [(r["head"], r["hosts"]) for r in degraded] == [(fabric.TP_HOSTS[0], " ".join(fabric.TP_HOSTS))]
    assert degraded[0]["missing_ranks"] > rule.threshold  # the group, named with the host it lost
    after = evaluated(down["end"] + window + SCRAPE)
    assert all(r["missing_ranks"] <= rule.threshold for r in after) and after

    seen = rows(
        demo_store,
        PANELS[("stagetrace-fabric", "TP hosts, last seen")],
        down["end"] - window,
        down["end"] - timedelta(seconds=1),
    )
    assert [r["host"] for r in seen] == [down["host"], fabric.TP_HOSTS[0]]  # the host that dropped out first
    assert at(seen[0]["last_seen"]) < down["start"] and at(seen[0]["last_scraped"]) < down["start"]


def _promtool_series(store, hosts: tuple[str, ...], t0: datetime) -> list[dict]:
    """The demo's samples of ``hosts`` as promtool input series on the scrape grid from ``t0``, with ``up``."""
    ticks = fabric.DURATION_S // fabric.SCRAPE_S + 1
    series: dict[str, list] = {}
    scraped: dict[str, set[int]] = defaultdict(set)
    for table in ("otel_metrics_gauge", "otel_metrics_sum"):
        result = store.client.query(
            f"SELECT MetricName, ResourceAttributes['host.name'], Attributes, TimeUnix, Value FROM {table} "
            "WHERE ResourceAttributes['host.name'] IN {hosts:Array(String)} AND TimeUnix >= {t0:DateTime64(9)}",
            parameters={"hosts": list(hosts), "t0": t0},
        )
        for name, host, attributes, time, value in result.result_rows:
            tick = round((time.replace(tzinfo=timezone.utc) - t0).total_seconds() / fabric.SCRAPE_S)
            if not 0 <= tick < ticks:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted({**attributes, "host": host}.items()))
            series.setdefault(f"{name}{{{labels}}}", ["_"] * ticks)[tick] = repr(float(value))
            scraped[host].add(tick)
    for host in hosts:
        series[f'up{{job="stagetrace",instance="{host}:9464"}}'] = [
            "1" if t in scraped[host] else "0" for t in range(ticks)
        ]
    return [{"series": name, "values": " ".join(values)} for name, values in sorted(series.items())]


def test_prometheus_rules_fire_on_the_demos_fabric_and_only_there(demo_store, truth, component, tmp_path):
    promtool = component("promtool", package="prometheus")
    (down,), degraded = truth["node_down"], truth["rail_degraded"]
    t0 = (degraded[0]["start"] - timedelta(seconds=fabric.RAIL_DEGRADED[0])).replace(microsecond=0)
    t0 += timedelta(seconds=1)  # the scrape after the scenario's start: every tick lands at or after it

    def offset(moment: datetime) -> str:
        return f"{int((moment - t0).total_seconds())}s"

    templates = {
        rule["alert"]: rule["annotations"]
        for group in yaml.safe_load(PROMETHEUS_RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }

    def annotations(name: str, labels: dict) -> dict:
        """The rule's annotations with the labels and the slow link's rate filled in, as Prometheus renders them."""
        out = {}
        for key, text in templates[name].items():
            text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
            out[key] = text.replace("{{ $value | humanize }}", "12.5G")
        return out

    def alerts(name: str, moment: datetime, expected: list[dict]) -> dict:
        return {
            "eval_time": offset(moment),
            "alertname": name,
            "exp_alerts": [{"exp_labels": e, "exp_annotations": annotations(name, e)} for e in expected],
        }

    slow = [{"severity": "warning", "host": e["host"], "device": e["device"], "port": "1"} for e in degraded]
    lost = [{"severity": "critical", "job": "stagetrace", "instance": f"{down['host']}:9464"}]
    test = {
        "rule_files": [str(PROMETHEUS_RULES)],
        "evaluation_interval": f"{fabric.SCRAPE_S}s",
        "tests": [
            {
                "interval": f"{fabric.SCRAPE_S}s",
                "input_series": _promtool_series(demo_store, fabric.TP_HOSTS, t0),
                "alert_rule_test": [
                    alerts("StagetraceNodeDown", down["start"] - SCRAPE, []),
                    alerts("StagetraceNodeDown", down["start"] + 2 * SCRAPE, lost),  # within two scrape intervals
                    alerts("StagetraceNodeDown", down["end"] + 2 * SCRAPE, []),
                    alerts("StagetraceRdmaLinkBelowPeers", degraded[0]["start"] + timedelta(minutes=4), []),
                    alerts(
                        "StagetraceRdmaLinkBelowPeers", degraded[0]["start"] + timedelta(minutes=5, seconds=30), slow
                    ),
                    alerts("StagetraceRdmaLinkBelowPeers", degraded[0]["end"] + 2 * SCRAPE, []),
                    alerts(
                        "StagetraceRdmaLinkRenegotiatedDown",
                        degraded[0]["start"] + timedelta(minutes=5, seconds=30),
                        slow,
                    ),
                    alerts(
                        "StagetraceRdmaRailsUnbalanced", degraded[0]["start"] + timedelta(minutes=5, seconds=30), []
                    ),
                ],
            }
        ],
    }
    (tmp_path / "demo.test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    done = subprocess.run(
        [promtool, "test", "rules", "demo.test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_gpu_that_missed_a_step_is_named_with_its_step_and_alerted(demo_store, truth):
    (missed,) = truth["weights_missed"]
    rule = RULES["stagetrace-weights-behind"]
    window = timedelta(seconds=rule.window_s)

    def behind(now: datetime) -> list[dict]:
        return [
            r
            for r in rows(demo_store, rule.sql, now - window, now)
            if r["service"] == fabric.ROLLOUT_SERVICE and r["steps_behind"] > rule.threshold
        ]

    during = missed["start"] + timedelta(seconds=90)
    assert [(r["host"], r["gpu"], r["fleet_step"]) for r in behind(during)] == [
        (missed["host"], missed["device"], str(missed["step"]))
    ]
    assert behind(missed["start"] - timedelta(seconds=1)) == []
    assert behind(missed["end"] + window) == []

    board = rows(demo_store, PANELS[("stagetrace-weights", "Step served per GPU")], during - window, during)
    lagging = [r for r in board if r["steps_behind"] > 0 and r["service"] == fabric.ROLLOUT_SERVICE]
    assert [(r["gpu"], r["step"], r["fleet_step"]) for r in lagging] == [
        (missed["device"], missed["step"] - 1, missed["step"])
    ]
    others = [r for r in board if r["service"] == fabric.ROLLOUT_SERVICE and r["gpu"] != missed["device"]]
    assert len(others) == len(fabric.ROLLOUT_HOSTS) - 1
    for r in others:  # the step arrived with the sync that carried it
        assert missed["start"] <= at(r["arrived"]) <= missed["start"] + timedelta(seconds=fabric.ROLLOUT_EVERY_S + 1)


def test_fan_in_is_detected_on_the_syncs_through_rank_0_and_not_on_all_to_all(demo_store, truth, span):
    syncs = rows(demo_store, PANELS[("stagetrace-weights", "Weight syncs")], *span)
    patterns = {e["step"]: e["detail"] for e in truth["weights_sync"]}
    assert {r["step"] for r in syncs} == set(patterns) and set(patterns.values()) == {"rank0", "all_to_all"}
    for r in syncs:
        assert (r["fan_in"] == "fan-in") == (patterns[r["step"]] == "rank0"), r
        if patterns[r["step"]] == "rank0":  # all of it through one training NIC, at that NIC's line rate
            assert r["source_share"] == 1 and r["of_line_rate"] == pytest.approx(1.0)
    rule = RULES["stagetrace-weights-fan-in"]
    first_all_to_all = min(e["start"] for e in truth["weights_sync"] if e["detail"] == "all_to_all")
    (early,) = rows(demo_store, rule.sql, first_all_to_all - timedelta(seconds=rule.window_s), first_all_to_all)
    (late,) = rows(demo_store, rule.sql, span[1] - timedelta(seconds=900), span[1])
    assert early["fan_in"] > rule.threshold >= late["fan_in"] == 0
