"""The durable spool: real files, real ClickHouse (chdb) failures, a real kill -9, exactly-once replay."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from stagetrace import schema
from stagetrace.agent import SerializedNode
from stagetrace.collectors.base import Node
from stagetrace.environment_variables import (
    STAGETRACE_SPOOL_DIR,
    STAGETRACE_SPOOL_KEEP_BYTES,
    STAGETRACE_SPOOL_MAX_BYTES,
)
from stagetrace.exporters import spool
from stagetrace.exporters.clickhouse import COLUMNS, ClickHouseMetricWriter, ClickHouseSpanExporter
from stagetrace.exporters.durable import DurableWriter
from stagetrace.store import open_store

ROOT = Path(__file__).resolve().parents[1]


def rows(n: int, start: int = 0) -> list[list]:
    return [[i, f"{i:032x}", f"{i:016x}"] for i in range(start, start + n)]


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.seg"))


def spooled_span_ids(directory: Path) -> list[str]:
    index = COLUMNS.index("SpanId")
    ids = []
    for path in segment_files(directory):
        doc = json.loads(zlib.decompress(path.read_bytes()))
        ids += [row[index] for row in doc["rows"]]
    return ids


def wait_until(what: str, probe, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- the spool on its own -------------------------------------------------------------------------------


def test_batches_come_back_in_order_with_their_tokens_and_survive_a_reopen(tmp_path):
    s = spool.Spool(tmp_path / "spans", max_bytes=10**6)
    for n in range(3):
        s.put("otel_traces", ("a", "b", "c"), rows(2, start=10 * n), f"token-{n}")
    assert len(s) == 3 and s.rows() == 6 and s.rows("otel_metrics_sum") == 0
    assert not list(s.directory.glob(".*.tmp"))  # written to a temporary name, then renamed
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in segment_files(tmp_path))
    s.close()
    again = spool.Spool(tmp_path / "spans", max_bytes=10**6)
    assert again.directory == s.directory  # the slot is free again, so the next writer takes it
    seen = []
    assert again.replay(lambda batch: seen.append((batch.token, batch.rows[0][0])) or True)
    assert seen == [("token-0", 0), ("token-1", 10), ("token-2", 20)]
    assert len(again) == 0 and not segment_files(tmp_path)


def test_a_failing_replay_stops_and_keeps_the_batch(tmp_path):
    s = spool.Spool(tmp_path / "spans")
    s.put("t", ("a",), [[1]], "x")
    s.put("t", ("a",), [[2]], "y")
    assert not s.replay(lambda batch: False)
    assert len(s) == 2


def test_a_full_spool_drops_the_oldest_and_counts_them(tmp_path, caplog):
    s = spool.Spool(tmp_path / "spans", max_bytes=10**6)
    first = s.put("otel_traces", ("a", "b", "c"), rows(100), "t0")
    s.max_bytes = first.size * 2 + first.size // 2  # room for two such segments
    before = spool.DROPPED.counts.get(("spans", "spool_full"), 0)
    for n in range(1, 4):
        s.put("otel_traces", ("a", "b", "c"), rows(100, start=100 * n), f"t{n}")
    assert len(s) == 2 and s.dropped_rows == 200
    assert spool.DROPPED.counts[("spans", "spool_full")] - before == 200
    assert [b.token for b in map(s.load, [s.oldest()])] == ["t2"]  # the newest survive
    assert sum("dropped 100 spans: the spool is full" in m for m in caplog.messages) == 2


def test_an_unreadable_segment_is_dropped_counted_and_skipped(tmp_path):
    s = spool.Spool(tmp_path / "spans")
    bad = s.put("t", ("a",), [[1]], "x")
    s.put("t", ("a",), [[2]], "y")
    bad.path.write_bytes(b"not zlib")
    seen = []
    assert s.replay(lambda batch: seen.append(batch.rows) or True)
    assert seen == [[[2]]] and s.dropped_rows == 1


def test_a_second_process_gets_its_own_slot_and_a_dead_ones_segments_are_adopted(tmp_path):
    base = tmp_path / "spans"
    script = textwrap.dedent(f"""
        import os, sys
        from stagetrace.exporters import spool
        s = spool.Spool({str(base)!r})
        s.put("t", ("a",), [[1]], "from-child")
        print(s.directory, flush=True)
        os.kill(os.getpid(), 9)
    """)
    holder = spool.Spool(base)  # slot 0 is held: the child takes slot 1, then dies without closing
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert Path(child.stdout.strip()) == base / "1"
    holder.close()
    adopter = spool.Spool(base)
    assert adopter.directory == base / "0" and adopter.rows() == 1
    assert adopter.load(adopter.oldest()).token == "from-child"


def test_spool_directory_settings(monkeypatch, tmp_path):
    from stagetrace.store import parse_dsn

    monkeypatch.delenv(STAGETRACE_SPOOL_DIR, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert spool.directory_setting(parse_dsn("chdb:///data/st/store")) == Path("/data/st/store.spool")
    assert spool.directory_setting(parse_dsn("chdb://memory")) is None
    assert (
        spool.directory_setting(parse_dsn("http://u:secret@ch:8123/db"))
        == tmp_path / "state/stagetrace/spool/ch-8123-db"
    )
    monkeypatch.setenv(STAGETRACE_SPOOL_DIR, str(tmp_path / "x"))
    assert spool.directory_setting(parse_dsn("chdb://memory")) == tmp_path / "x"
    monkeypatch.setenv(STAGETRACE_SPOOL_DIR, "off")
    assert spool.directory_setting(parse_dsn("chdb:///data/st/store")) is None
    # the one size grammar (stagetrace.settings), as --min-free-space and the query limits read it
    for text, size in (("1000000", 1_000_000), ("256MiB", 256 << 20), ("1.5G", 3 << 29), ("2GB", 2 * 10**9)):
        monkeypatch.setenv(STAGETRACE_SPOOL_MAX_BYTES, text)
        assert spool.max_bytes_setting() == size
    monkeypatch.setenv(STAGETRACE_SPOOL_KEEP_BYTES, "8MiB")
    assert spool.keep_bytes_setting(tmp_path) == 8 << 20


def test_a_spool_size_that_is_no_size_is_said_once_and_the_default_kept(monkeypatch, caplog):
    monkeypatch.setenv(STAGETRACE_SPOOL_MAX_BYTES, "lots")
    assert spool.max_bytes_setting() == spool.DEFAULT_MAX_BYTES
    assert caplog.messages == [
        f"ignoring {STAGETRACE_SPOOL_MAX_BYTES}: 'lots' is not a positive size: write e.g. 1GiB, "
        f"512MiB or 1000000; using {spool.DEFAULT_MAX_BYTES} bytes"
    ]


def test_an_unusable_spool_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(spool.SpoolError, match=r"cannot use the spool directory .*STAGETRACE_SPOOL_DIR"):
        spool.Spool(blocker / "spans")


# --- idempotent inserts in the real engine --------------------------------------------------------------


def sdk_rows() -> list[tuple]:
    """The rows of a real SDK request: a root span with a request ID and one stage span."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from stagetrace.exporters.rows import Resources, span_row

    spans = []
    capture = type("Capture", (), {"export": lambda self, batch: spans.extend(batch), "shutdown": lambda self: None})
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(capture()))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("root", attributes={"stagetrace.request.id": "r1"}):
        with tracer.start_as_current_span("decode", attributes={"stagetrace.stage": "decode"}):
            pass
    return [span_row(s, Resources()) for s in spans]


def test_the_same_batch_under_the_same_token_is_stored_once_in_the_table_and_its_views(store):
    writer = DurableWriter(store, "spans", spool_dir=False)
    batch = sdk_rows()

    def counts():
        return [
            store.client.command(f"SELECT count() FROM stagetrace.{t}")
            for t in ("otel_traces", "stagetrace_requests", "stagetrace_stages", "otel_traces_trace_id_ts")
        ]

    for _ in range(3):
        assert writer.write("otel_traces", COLUMNS, batch, "the-same-token")
    assert counts() == [2, 1, 1, 1]
    assert writer.write("otel_traces", COLUMNS, batch, "another-token")  # equal rows, another batch: kept
    assert counts() == [4, 2, 2, 2]
    assert writer.write("otel_traces", COLUMNS, batch)  # no token given: a fresh one, never a data-hash match
    assert counts() == [6, 3, 3, 3]
    writer.close()


def test_a_store_upgraded_from_version_2_gets_the_deduplication_window(tmp_path):
    with open_store(f"chdb://{tmp_path / 'store'}", create_schema=False) as store:
        client = store.client
        for sql in schema.statements():
            client.command(sql.replace(", non_replicated_deduplication_window = 1000", ""))
        client.command("INSERT INTO stagetrace.stagetrace_schema_version (Version) VALUES (2)")
        create = client.command("SHOW CREATE TABLE stagetrace.otel_traces")
        assert "non_replicated_deduplication_window" not in create
        assert store.ensure_schema() is True
        for table in schema.SETTING_CHANGES[3][1]:
            assert "non_replicated_deduplication_window = 1000" in client.command(
                f"SHOW CREATE TABLE stagetrace.{table}"
            )
        assert schema.installed_version(client, "stagetrace") == schema.SCHEMA_VERSION


# --- the exporters through an outage --------------------------------------------------------------------


class CommitThenFail:
    """A store whose inserts commit but report failure, as a timed-out insert to a server does."""

    def __init__(self, client, failures: int):
        self.failures = failures
        real = client.insert

        def insert(*args, **kwargs):
            real(*args, **kwargs)
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("read timed out")

        client.insert = insert


def steady_load(tracer, stop: threading.Event, sent: list, rate_hz: float = 400):
    n = 0
    while not stop.is_set():
        with tracer.start_as_current_span("req", attributes={"stagetrace.request.id": f"req-{n}"}):
            pass
        sent.append(f"req-{n}")
        n += 1
        time.sleep(1 / rate_hz)


def test_every_span_sent_through_an_outage_is_stored_exactly_once(store, caplog):
    caplog.set_level(logging.INFO)
    CommitThenFail(store.client, failures=2)  # the first two batches land, yet are spooled and replayed
    exporter = ClickHouseSpanExporter(store=store)
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=20, max_queue_size=100_000))
    stop, sent = threading.Event(), []
    load = threading.Thread(target=steady_load, args=(provider.get_tracer("t"), stop, sent))
    load.start()
    try:
        time.sleep(1.0)
        store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")  # outage
        outage_began = len(sent)
        wait_until("batches in the spool", lambda: exporter.spool.rows() >= 400)
        time.sleep(1.0)
        store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
        outage_ended = len(sent)
        time.sleep(1.0)
    finally:
        stop.set()
        load.join()
    assert provider.force_flush() and exporter.force_flush(30_000)
    provider.shutdown()
    stored = dict(
        store.client.query(
            "SELECT SpanAttributes['stagetrace.request.id'] AS id, count() FROM stagetrace.otel_traces GROUP BY id"
        ).result_rows
    )
    assert 0 < outage_began and outage_ended - outage_began >= 300 and len(sent) > outage_ended  # before, in, after
    assert set(stored) == set(sent) and set(stored.values()) == {1}
    assert store.client.command("SELECT count() FROM stagetrace.stagetrace_requests") == len(sent)
    assert exporter.dropped_spans == 0 and not segment_files(Path(f"{store.location.path}.spool"))
    assert any("will retry" in m for m in caplog.messages) and any("work again" in m for m in caplog.messages)


def test_the_metric_writer_spools_through_an_outage_and_replays_in_order(store):
    from tests.test_metric_writer import T0, rdma_families  # the same real RDMA fixture families

    writer = ClickHouseMetricWriter(store, host="node-a")
    families = rdma_families()
    (sum_ddl,) = [s for s in schema.statements() if "`otel_metrics_sum`" in s]
    store.client.command("DROP TABLE stagetrace.otel_metrics_sum")
    for i in range(3):
        assert not writer.write(families, time_ns=T0 + i)
    per_write = writer.held_rows // 3
    assert writer.spool.rows("otel_metrics_sum") == 3 * per_write and len(writer.spool) == 3
    store.client.command(sum_ddl)
    assert writer.write(families, time_ns=T0 + 3) and writer.held_rows == 0
    times = store.client.query(
        "SELECT toUnixTimestamp64Nano(TimeUnix) AS t, count() FROM stagetrace.otel_metrics_sum GROUP BY t ORDER BY t"
    ).result_rows
    assert times == [(T0 + i, per_write) for i in range(4)]
    assert writer.close()


def test_a_full_spool_is_counted_in_the_agents_metrics(tmp_path, store):
    exporter = ClickHouseSpanExporter(store=store, spool_max_bytes=1)  # nothing fits
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    for _ in range(5):
        provider.get_tracer("t").start_span("s").end()
    provider.force_flush()
    wait_until("the spans to be dropped", lambda: exporter.dropped_spans == 5, timeout=10)
    node = SerializedNode(Node([], "node-a"))
    (family,) = [f for f in node.collect() if f.name == "stagetrace_dropped_spans"]
    by_reason = {s.labels["reason"]: s.value for s in family.samples if s.labels["host"] == "node-a"}
    assert set(by_reason) == set(spool.REASONS) and by_reason["spool_full"] >= 5
    assert exporter.refused_spans == 5  # answered FAILURE: the SDK knows they were not taken
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    provider.shutdown()


_CHILD = """
import os, sys, time
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
from stagetrace.store import open_store

store = open_store(sys.argv[1])
exporter = ClickHouseSpanExporter(store=store)
provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=20))
tracer = provider.get_tracer("t")
for n in range(200):  # before the outage: stored at once
    tracer.start_span(f"s{n}").end()
assert provider.force_flush() and exporter.force_flush(10_000)
store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
print("outage", flush=True)
n = 200
while True:  # steady load until killed
    tracer.start_span(f"s{n}").end()
    n += 1
    time.sleep(0.002)
"""


def test_what_a_killed_process_spooled_is_replayed_once_by_the_next(tmp_path):
    dsn = f"chdb://{tmp_path / 'store'}"
    spool_dir = tmp_path / "store.spool"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, dsn], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert child.stdout.readline().strip() == "outage", child.stderr.read()
        wait_until("the child to spool", lambda: len(segment_files(spool_dir)) >= 5)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    spooled = spooled_span_ids(spool_dir)
    assert len(spooled) == len(set(spooled)) >= 5
    last = json.loads(zlib.decompress(segment_files(spool_dir)[-1].read_bytes()))
    with open_store(dsn) as store:
        store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
        before = store.client.command("SELECT count() FROM stagetrace.otel_traces")
        assert before >= 200
        exporter = ClickHouseSpanExporter(store=store)  # replays on start, without an export
        wait_until("the replay", lambda: len(exporter.spool) == 0)
        stored = dict(
            store.client.query("SELECT SpanId, count() FROM stagetrace.otel_traces GROUP BY SpanId").result_rows
        )
        assert all(stored.get(span_id) == 1 for span_id in spooled)
        assert len(stored) == sum(stored.values()) == before + len(spooled)
        # a kill after a replayed insert, before its segment was removed, replays it once more: that adds nothing
        again = DurableWriter(store, "spans", spool_dir=False)
        assert again.insert(last["table"], tuple(last["columns"]), last["rows"], last["token"])
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == before + len(spooled)
        exporter.shutdown()
    assert not segment_files(spool_dir)
    assert os.path.isdir(spool_dir / "spans" / "0")


def test_the_otlp_receiver_takes_spans_through_an_outage_and_stores_each_once(store):
    from tests.test_otlp import _vllm_protobuf, post

    from stagetrace.exporters.otlp import OtlpReceiver

    receiver = OtlpReceiver(store, "127.0.0.1:0")
    template = ExportTraceServiceRequest.FromString(_vllm_protobuf())

    def body(n: int) -> bytes:  # another request each time: new span IDs
        for span in template.resource_spans[0].scope_spans[0].spans:
            span.span_id = (n + 1).to_bytes(8, "big")
        return template.SerializeToString()

    try:
        assert post(f"{receiver.url}/v1/traces", body(0), "application/x-protobuf")[0] == 200
        assert receiver.writer.flush()
        per_request = store.client.command("SELECT count() FROM stagetrace.otel_traces")
        store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
        for n in range(1, 31):  # answered 200 once fsynced in the spool, never 503
            assert post(f"{receiver.url}/v1/traces", body(n), "application/x-protobuf")[0] == 200
            assert receiver.writer.spooled_rows() == n * per_request
        store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
        assert receiver.writer.flush(30)
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 31 * per_request
    finally:
        receiver.close()


def test_spans_spooled_during_an_outage_wait_for_the_next_exporter_which_writes_them(store, caplog):
    exporter = ClickHouseSpanExporter(store=store)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    for n in range(50):
        provider.get_tracer("t").start_span(f"held-{n}").end()
    started = time.monotonic()
    provider.shutdown()  # the SDK flushes into the exporter, which spools rather than wait out the outage
    assert time.monotonic() - started < 10
    assert exporter.spool.rows() == 50 and exporter.dropped_spans == 0
    assert any("wait in the spool" in m for m in caplog.messages)
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    successor = ClickHouseSpanExporter(store=store)
    wait_until("the replay", lambda: len(successor.spool) == 0)
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces WHERE startsWith(SpanName, 'held-')") == 50
    successor.shutdown()


def test_a_disk_that_refuses_the_segment_drops_and_counts_it_and_the_spool_goes_on(tmp_path, caplog):
    import resource

    s = spool.Spool(tmp_path / "spans")
    s.put("t", ("a",), [[1]], "x")
    # a real write failure, also for root: the kernel refuses writes past RLIMIT_FSIZE (EFBIG), as a full disk would
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, limits[1]))
    try:
        assert s.put("t", ("a",), [[n] for n in range(100)], "y") is None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert s.dropped_rows == 100 and len(s) == 1 and "cannot write" in caplog.text
    assert not list(s.directory.glob(".*.tmp"))
    assert s.put("t", ("a",), [[4]], "z") is not None and len(s) == 2
