"""The store says when it is hurt (``stagetrace.store_health``): parts the engine detached as broken are named.

Real stores, real damage: a part file truncated while the agent was down, which the engine moves aside as
``broken-on-start`` when the agent starts again; and a part moved into ``detached/`` under the name the engine
gives a part it finds broken while running. Each is one log line naming the table, the part, its rows and its time
range, and ``stagetrace_store_broken_parts`` on the agent's ``/metrics``; the agent restores the truncated part's
rows from the spool's kept records, each once, and says so in one line, or says how many it could not restore.
"""

from __future__ import annotations

import re
import shutil
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tests.agents import Agent

from stagetrace.exporters.durable import DurableWriter
from stagetrace.exporters.rows import COLUMNS, Resources, span_row, span_views
from stagetrace.store import open_store
from stagetrace.store_health import BROKEN_PARTS, StoreHealth

T0 = 1_700_000_000_000_000_000  # 2023-11-14 22:13:20 UTC


def request(n: int, spans: int = 100) -> ExportTraceServiceRequest:
    """``spans`` stage spans one second apart from T0 + n minutes, IDs of their own."""
    message = ExportTraceServiceRequest()
    scope = message.resource_spans.add().scope_spans.add()
    for k in range(spans):
        start = T0 + n * 60 * 10**9 + k * 10**9
        scope.spans.add(
            name=f"part-{n}",
            trace_id=(n + 1).to_bytes(16, "big"),
            span_id=(n * spans + k + 1).to_bytes(8, "big"),
            start_time_unix_nano=start,
            end_time_unix_nano=start + 1000,
        )
        stage = scope.spans[-1].attributes.add(key="stagetrace.stage")
        stage.value.string_value = "decode"
    return message


def send(agent: Agent, n: int) -> None:
    """``request(0)`` to ``request(n - 1)`` over OTLP/HTTP to ``agent``, each answered 200."""
    for k in range(n):
        post = urllib.request.Request(
            f"{agent.endpoints['otlp']}/v1/traces",
            data=request(k).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        with urllib.request.urlopen(post, timeout=30) as answer:
            assert answer.status == 200


def table_directory(store_path: Path, table: str) -> Path:
    """Where the embedded engine keeps ``table``'s parts: ``store/<uuid[:3]>/<uuid>`` from its metadata."""
    uuid = re.search(r"UUID '([0-9a-f-]+)'", (store_path / "metadata" / "stagetrace" / f"{table}.sql").read_text())[1]
    return store_path / "store" / uuid[:3] / uuid


def broken_parts_metric(metrics: str, name: str = "stagetrace_store_broken_parts") -> dict[str, float]:
    series = re.compile(rf'^{name}\{{[^}}]*table="([^"]+)"[^}}]*\}} (\S+)$', re.M)
    return {m[1]: float(m[2]) for m in series.finditer(metrics)}


def spans_by_id(store_path: Path, table: str = "otel_traces") -> dict[str, int]:
    """How many times ``table`` (the spans, or a table a view fills from them) holds each test span."""
    with open_store(f"chdb://{store_path}") as store:
        return dict(
            store.client.query(
                "SELECT lower(SpanId), count() FROM stagetrace.{table:Identifier} "
                "WHERE startsWith(SpanName, 'part-') GROUP BY SpanId",
                parameters={"table": table},
            ).result_rows
        )


def sent_ids(n: int) -> list[str]:
    return [f"{s.span_id.hex()}" for s in request(n).resource_spans[0].scope_spans[0].spans]


def truncate_a_part(store_path: Path, table: str = "otel_traces") -> tuple[Path, int]:
    """While the agent is down, a part of ``table`` loses the end of a data file (a disk that failed, a copy cut
    short): the part and its rows."""
    parts = [p for p in table_directory(store_path, table).iterdir() if (p / "count.txt").exists()]
    blocks = {p: tuple(int(n) for n in p.name.split("_")[1:3]) for p in parts}
    # an active part: the parts a merge replaced stay on disk for a while (part_guard.SOURCES_KEPT_S)
    active = [
        p
        for p in parts
        if not any(
            q != p
            and q.name.split("_")[0] == p.name.split("_")[0]
            and blocks[q][0] <= blocks[p][0]
            and blocks[p][1] <= blocks[q][1]
            for q in parts
        )
    ]
    victim = sorted(active)[0]
    data = max(victim.glob("*.bin"), key=lambda p: p.stat().st_size)
    with data.open("r+b") as out:
        out.truncate(data.stat().st_size // 2)
    return victim, int((victim / "count.txt").read_text())


def test_a_part_truncated_while_the_agent_was_down_is_named_at_start_and_counted_on_metrics(tmp_path):
    agent = Agent(tmp_path)
    try:
        send(agent, 3)  # three requests: three parts, unless merged meanwhile
        healthy = urllib.request.urlopen(agent.endpoints["metrics"], timeout=10).read().decode()
    finally:
        log = agent.stop()
    assert broken_parts_metric(healthy)["otel_traces"] == 0  # every table from the start, zero included
    assert "detached part" not in log
    acknowledged = [span_id for n in range(3) for span_id in sent_ids(n)]
    assert spans_by_id(agent.store) == dict.fromkeys(acknowledged, 1)
    victim, rows = truncate_a_part(agent.store)
    again = Agent(tmp_path)
    try:
        metrics = urllib.request.urlopen(again.endpoints["metrics"], timeout=10).read().decode()
    finally:
        log = again.stop()
    lines = [line for line in log.splitlines() if "detached part" in line]
    assert len(lines) == 1, log
    assert (
        f"table otel_traces: the engine detached part {victim.name} as broken-on-start ({rows:,} rows, 2023-11-14 22:"
    ) in lines[0], lines[0]
    assert " UTC, " in lines[0] and "its rows are no longer read" in lines[0]
    assert broken_parts_metric(metrics)["otel_traces"] == 1
    assert (table_directory(agent.store, "otel_traces") / "detached" / f"broken-on-start_{victim.name}").is_dir()
    # its rows are back, from the records the spool kept after storing them, and no span is stored twice
    restored = [line for line in log.splitlines() if "restored" in line]
    assert restored == [
        f"stagetrace agent: store: table otel_traces: restored all {rows:,} rows of part {victim.name} "
        "from the spool's kept records"
    ], log
    assert spans_by_id(agent.store) == dict.fromkeys(acknowledged, 1)
    # the stage rows the views derived kept their own parts: the restore leaves them as they were, none twice
    assert spans_by_id(agent.store, "stagetrace_stages") == dict.fromkeys(acknowledged, 1)
    # restored once: the next start names the part again (it stays detached for a person to look at) but restores
    # nothing twice
    log = Agent(tmp_path).stop()
    assert len([line for line in log.splitlines() if "detached part" in line]) == 1 and "restored" not in log, log
    assert spans_by_id(agent.store) == dict.fromkeys(acknowledged, 1)


def test_rows_older_than_the_kept_records_are_counted_as_not_restored(tmp_path):
    """With no records kept (STAGETRACE_SPOOL_KEEP_BYTES=0), the truncated part's rows cannot come back: the agent
    says exactly how many are lost and why, in one line."""
    agent = Agent(tmp_path, env={"STAGETRACE_SPOOL_KEEP_BYTES": "0"})
    try:
        send(agent, 2)
    finally:
        agent.stop()
    assert len(spans_by_id(agent.store)) == 200
    victim, rows = truncate_a_part(agent.store)
    for start in range(2):  # the loss stays on /metrics after a restart, while the part is there to look at
        again = Agent(tmp_path, env={"STAGETRACE_SPOOL_KEEP_BYTES": "0"})
        try:
            metrics = urllib.request.urlopen(again.endpoints["metrics"], timeout=10).read().decode()
        finally:
            log = again.stop()
        lost = {
            what: broken_parts_metric(metrics, f"stagetrace_store_lost_rows{what}")["otel_traces"]
            for what in ("", "_first_timestamp_seconds", "_last_timestamp_seconds")
        }
        assert lost[""] == rows and broken_parts_metric(metrics, "stagetrace_store_lost_rows")["stagetrace_stages"] == 0
        assert lost["_first_timestamp_seconds"] == 1_700_000_000 < lost["_last_timestamp_seconds"] < 1_700_001_000
        said = [line for line in log.splitlines() if "restored" in line]
        if start == 0:  # said once, in one line: how many, when, and why
            (line,) = said
            last = datetime.fromtimestamp(lost["_last_timestamp_seconds"], timezone.utc)
            assert (
                f"restored 0 rows of part {victim.name} from the spool's kept records; lost {rows:,} of its "
                f"{rows:,} rows (2023-11-14 22:13:20 to {last:%Y-%m-%d %H:%M:%S} UTC): the spool keeps no records "
                "(STAGETRACE_SPOOL_KEEP_BYTES)"
            ) in line, line
        else:
            assert not said, log
    assert len(spans_by_id(agent.store)) == 200 - rows


def test_a_broken_part_of_a_table_the_views_fill_is_rebuilt_from_the_spans_each_row_once(tmp_path):
    """A part of stagetrace_stages truncated while the agent was down: at start its rows are made again from
    otel_traces by the views' own queries, and every stage span is in the table once; nothing is counted lost."""
    agent = Agent(tmp_path)
    try:
        send(agent, 3)
    finally:
        agent.stop()
    acknowledged = [span_id for n in range(3) for span_id in sent_ids(n)]
    assert spans_by_id(agent.store, "stagetrace_stages") == dict.fromkeys(acknowledged, 1)
    victim, rows = truncate_a_part(agent.store, "stagetrace_stages")
    again = Agent(tmp_path)
    try:
        metrics = urllib.request.urlopen(again.endpoints["metrics"], timeout=10).read().decode()
    finally:
        log = again.stop()
    assert broken_parts_metric(metrics)["stagetrace_stages"] == 1
    assert broken_parts_metric(metrics, "stagetrace_store_lost_rows")["stagetrace_stages"] == 0
    (line,) = [line for line in log.splitlines() if "rebuilt" in line]
    assert f"store: table stagetrace_stages: rebuilt {rows:,} rows of part {victim.name} (2023-11-14 22:1" in line, log
    assert spans_by_id(agent.store, "stagetrace_stages") == dict.fromkeys(acknowledged, 1)
    assert spans_by_id(agent.store) == dict.fromkeys(acknowledged, 1)


def test_a_part_the_engine_detaches_as_broken_while_running_is_found_by_the_next_check_and_named_once(store, caplog):
    writer = DurableWriter(store, "spans", spool_dir=False)
    for n in range(2):
        rows = [span_row(view, Resources()) for view in span_views(request(n))[0]]
        assert writer.insert("otel_traces", COLUMNS, rows, f"health-{n}")
    writer.close()
    health = StoreHealth(store)
    assert health.check() == [] and not health.failed
    families = {
        s.labels["table"]: s.value for f in health.families("node-a") if f.name == BROKEN_PARTS.name for s in f.samples
    }
    assert families["otel_traces"] == 0 and "stagetrace_requests" in families
    # the engine moves a part it finds broken into detached/ as broken_<part>; here a part is moved as it would be
    ((name,),) = store.client.query(
        "SELECT name FROM system.parts WHERE database = 'stagetrace' AND "
        "table = 'otel_traces' AND active ORDER BY name LIMIT 1"
    ).result_rows
    store.client.command(f"ALTER TABLE stagetrace.otel_traces DETACH PART '{name}'")
    detached = table_directory(Path(store.location.path), "otel_traces") / "detached"
    shutil.move(detached / name, detached / f"broken_{name}")
    (found,) = health.check()
    assert (found.table, found.reason, found.rows) == ("otel_traces", "broken", 100)
    assert f"{found.first:%Y-%m-%d %H:%M:%S}" == "2023-11-14 22:13:20" and f"{found.last:%H:%M:%S}" == "22:14:59"
    families = {
        s.labels["table"]: s.value for f in health.families("node-a") if f.name == BROKEN_PARTS.name for s in f.samples
    }
    assert families["otel_traces"] == 1 and BROKEN_PARTS.name == "stagetrace_store_broken_parts"
    assert health.check() == [found]  # still there: counted, not said again
    said = [m for m in caplog.messages if "detached part" in m]
    assert said == [
        f"store: table otel_traces: the engine detached part {name} as broken (100 rows, 2023-11-14 "
        f"22:13:20 to 2023-11-14 22:14:59 UTC, {found.bytes:,} bytes): its rows are no longer read; its "
        f"files are in {found.path}"
    ]
