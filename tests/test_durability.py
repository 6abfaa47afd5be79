"""The one write path (``exporters.durable``): rows the store can never take are isolated, not a whole batch lost.

Real chdb stores and real failures: a value clickhouse-connect cannot serialise into its column, and a table
renamed away (the store refusing every insert). Kill -9 tests of the processes that use this path are in
``tests/test_kill.py``.
"""

import logging

from stagetrace.exporters import spool
from stagetrace.exporters.clickhouse import METRIC_COLUMNS
from stagetrace.exporters.durable import DurableWriter
from stagetrace.exporters.otlp import TRACES

T0 = 1_700_000_000_000_000_000


def gauge_rows(n: int, poisoned: set[int] = frozenset()) -> list[tuple]:
    """``n`` gauge rows in the metric writer's layout; ``poisoned`` rows carry a value no Float64 column takes."""
    return [
        (
            {"host.name": "node-a"},
            "agent",
            "scope",
            "1",
            "gpu_temperature_celsius",
            "",
            "",
            {"gpu": str(i)},
            0,
            T0 + i,
            "not a number" if i in poisoned else float(i),
        )
        for i in range(n)
    ]


def stored_gpus(store) -> list[int]:
    rows = store.client.query("SELECT Attributes['gpu'] FROM stagetrace.otel_metrics_gauge").result_rows
    return sorted(int(gpu) for (gpu,) in rows)


def test_one_row_the_store_cannot_take_is_dropped_counted_and_the_rest_of_its_batch_lands(store, caplog):
    writer = DurableWriter(store, "metrics")
    before = spool.DROPPED.counts.get(("metric_samples", "rejected_row"), 0)
    assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(100, poisoned={37, 80}))
    assert stored_gpus(store) == [i for i in range(100) if i not in (37, 80)]
    assert writer.dropped_rows == 2
    assert spool.DROPPED.counts[("metric_samples", "rejected_row")] - before == 2
    refusals = [r for r in caplog.records if "the store refuses" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].exc_info is None  # one line per reason, no traceback
    assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)
    assert writer.spooled_rows() == 0  # nothing left to retry forever
    writer.close()


def test_a_store_refusing_every_insert_is_not_split_and_the_batch_is_kept_whole(store):
    writer = DurableWriter(store, "metrics")
    store.client.command("RENAME TABLE stagetrace.otel_metrics_gauge TO stagetrace.gauge_away")
    assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(50))  # True: fsynced in the spool
    assert writer.dropped_rows == 0 and writer.spooled_rows("otel_metrics_gauge") == 50 and len(writer.spool) == 1
    store.client.command("RENAME TABLE stagetrace.gauge_away TO stagetrace.otel_metrics_gauge")
    assert writer.flush()
    assert stored_gpus(store) == list(range(50))
    writer.close()


def test_a_poisoned_batch_spooled_in_an_outage_lands_without_its_poison_when_replayed_twice(store):
    """A replay of the same spooled batch (a kill before its segment was removed) splits it alike: the halves'
    tokens derive from the batch's, so what landed the first time is not stored again."""
    writer = DurableWriter(store, "metrics")
    store.client.command("RENAME TABLE stagetrace.otel_metrics_gauge TO stagetrace.gauge_away")
    assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(40, poisoned={3}), token="batch-1")
    store.client.command("RENAME TABLE stagetrace.gauge_away TO stagetrace.otel_metrics_gauge")
    batch = writer.spool.load(writer.spool.oldest())
    assert writer.flush()
    assert writer.insert(batch.table, batch.columns, batch.rows, batch.token)  # the same batch once more
    assert stored_gpus(store) == [i for i in range(40) if i != 3]
    writer.close()


def test_without_a_spool_a_failing_store_is_reported_and_nothing_is_claimed(store):
    writer = DurableWriter(store, "metrics", spool_dir=False)
    store.client.command("RENAME TABLE stagetrace.otel_metrics_gauge TO stagetrace.gauge_away")
    assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(5)) is False
    store.client.command("RENAME TABLE stagetrace.gauge_away TO stagetrace.otel_metrics_gauge")
    assert stored_gpus(store) == []
    writer.close()


# --- write-ahead records: what the OTLP receivers write before they answer ------------------------------------


def trace_request(n: int, spans: int = 3) -> bytes:
    """An ``ExportTraceServiceRequest`` of ``spans`` spans whose IDs no other ``n`` uses."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for k in range(spans):
        span = scope.spans.add(
            name=f"stage-{k}", trace_id=(n + 1).to_bytes(16, "big"), span_id=(n * spans + k + 1).to_bytes(8, "big")
        )
        span.start_time_unix_nano, span.end_time_unix_nano = T0 + k, T0 + k + 10
    return request.SerializeToString()


def stored_spans(store) -> int:
    return store.client.command("SELECT count() FROM stagetrace.otel_traces")


def test_requests_written_ahead_in_an_outage_are_stored_each_once_in_few_inserts(store):
    writer = DurableWriter(store, "spans")
    inserts = []
    insert = store.client.insert
    # rows per insert, whether they are sent as rows or as columns
    store.client.insert = lambda *a, **k: (
        inserts.append(len(a[1][0] if k.get("column_oriented") else a[1])) or insert(*a, **k)
    )
    try:
        store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.traces_away")
        for n in range(40):
            assert writer.write_ahead(TRACES, trace_request(n), 3, spool.new_token())  # fsynced: acknowledge
        assert writer.spooled_rows() == 120
        store.client.command("RENAME TABLE stagetrace.traces_away TO stagetrace.otel_traces")
        assert writer.flush()
    finally:
        store.client.insert = insert
        writer.close()
    assert (
        stored_spans(store) == 120
        and store.client.command("SELECT uniqExact(SpanId) FROM stagetrace.otel_traces") == 120
    )
    assert sum(n for n in inserts) == 120 and len(inserts) < 40  # many requests, one insert (at most a few)


def test_a_backlog_is_stored_in_inserts_of_whole_requests_of_up_to_the_group_s_rows(store):
    """A backlog of written-ahead requests is inserted in groups of whole requests, each of at most ``group_rows``
    rows (``MAX_GROUP_ROWS`` in the agent): with merges stopped, each insert is one part of ``otel_traces``."""
    store.client.command("SYSTEM STOP MERGES stagetrace.otel_traces")
    backlog = spool.open_spool(store.location, "spans")
    for n in range(10):
        assert backlog.put_record(TRACES.name, trace_request(n, spans=5), 5, spool.new_token())
    backlog.close()
    writer = DurableWriter(store, "spans", group_rows=20)
    try:
        assert writer.flush()
    finally:
        writer.close()
    parts = store.client.query(
        "SELECT rows FROM system.parts WHERE database = 'stagetrace' AND table = 'otel_traces' "
        "AND active ORDER BY min_block_number"
    ).result_columns[0]
    assert parts == [20, 20, 10] and stored_spans(store) == 50


def test_a_group_stored_just_before_a_crash_adds_nothing_when_the_next_writer_replays_it(store):
    """A crash between a group's insert and the removal of its records (part of them removed): the next
    writer finds the rest still sealed into the group and inserts them under the group's token again."""
    from stagetrace.exporters.durable import MAX_GROUP_ROWS
    from stagetrace.exporters.records import decoder

    crashed = spool.open_spool(store.location, "spans")
    for n in range(5):
        assert crashed.put_record(TRACES.name, trace_request(n), 3, spool.new_token())
    group, members = crashed.head_group(MAX_GROUP_ROWS)
    assert len(members) == 5
    rows = [row for m in members for row in decoder(m.table)(crashed.read_record(m))["otel_traces"][1]]
    columns = TRACES.decode(crashed.read_record(members[0]))["otel_traces"][0]
    assert DurableWriter(store, "spans", spool_dir=False).insert("otel_traces", columns, rows, group)
    crashed.remove(members[0])  # the crash, midway through removing the group's records
    crashed.close()
    assert stored_spans(store) == 15
    after = DurableWriter(store, "spans")
    try:
        assert after.spooled_rows() == 12 and after.flush()
        assert stored_spans(store) == 15 and after.spooled_rows() == 0
    finally:
        after.close()


def test_a_full_spool_refuses_new_requests_and_drops_none_it_acknowledged(store, caplog):
    body = trace_request(0)
    writer = DurableWriter(store, "spans", spool_max_bytes=len(body) * 3 + 10)
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.traces_away")
    try:
        answers = [writer.write_ahead(TRACES, trace_request(n), 3, spool.new_token()) for n in range(50)]
        assert answers == [True] * 3 + [False] * 47  # refused: the sender keeps them and retries
        assert writer.dropped_rows == 0
        store.client.command("RENAME TABLE stagetrace.traces_away TO stagetrace.otel_traces")
        assert writer.flush() and stored_spans(store) == 9
        assert writer.write_ahead(TRACES, trace_request(3), 3, spool.new_token())  # room again
    finally:
        writer.close()
    # the spell in two lines, not a line per refused request
    assert sum("is full" in m for m in caplog.messages) == 1
    assert [m for m in caplog.messages if "takes requests again" in m][0].endswith(
        "(full meanwhile: refused 47 requests)"
    )


def test_a_running_writer_adopts_what_a_writer_that_is_gone_wrote_ahead(store):
    """The replay thread looks for slots nobody holds every ADOPT_EVERY_S: records another writer left (it
    exited or was killed) reach the store without waiting for a restart."""
    import time

    from stagetrace.exporters.durable import ADOPT_EVERY_S

    running = DurableWriter(store, "spans")
    try:
        gone = spool.open_spool(store.location, "spans")  # the next free slot, beside the running writer's
        assert gone.directory != running.spool.directory
        for n in range(4):
            assert gone.put_record(TRACES.name, trace_request(n), 3, spool.new_token())
        gone.close()  # its slot is free now, its records left in it
        deadline = time.monotonic() + 3 * ADOPT_EVERY_S
        while stored_spans(store) < 12 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stored_spans(store) == 12 and not any(gone.directory.glob("*.wal"))
    finally:
        running.close()


# --- a store without room: ClickHouse's NOT_ENOUGH_SPACE ------------------------------------------------------


def test_a_server_store_answering_not_enough_space_keeps_every_request_spooled_and_stores_it_once_later(
    tmp_path, caplog
):
    """A ClickHouse server whose disk is below its free-space guard answers inserts with NOT_ENOUGH_SPACE (code
    243): the store is unavailable, not the rows. Nothing is split or dropped; the requests wait in the spool, the
    failure is one log line, and they land once the server takes inserts again. The server is ClickHouse's HTTP
    interface over the engine in a process of its own (``benchmarks.clickhouse_http``), its guard the table's
    ``min_free_disk_bytes_to_perform_insert`` set beyond any disk."""
    import time

    from tests.agents import server_store

    from stagetrace.store import open_store

    with server_store(tmp_path / "server") as port:
        with open_store(f"http://default@127.0.0.1:{port}/stagetrace") as store:
            guard = "ALTER TABLE stagetrace.otel_traces MODIFY SETTING min_free_disk_bytes_to_perform_insert = {}"
            store.client.command(guard.format(10**18))
            # a client of its own, as the agent gives each thread: one HTTP session runs one query at a time, and
            # this test asks the store while the writer's thread inserts
            writer = DurableWriter(store.another(), "spans", spool_dir=tmp_path / "spool")
            try:
                for n in range(10):
                    assert writer.write_ahead(TRACES, trace_request(n), 3, spool.new_token())
                assert not writer.flush(timeout_s=1.0)  # the server refuses: they stay
                deadline = time.monotonic() + 10
                while not any("NOT_ENOUGH_SPACE" in m for m in caplog.messages) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert writer.spooled_rows() == 30 and writer.dropped_rows == 0 and stored_spans(store) == 0
                store.client.command(guard.format(0))  # room again
                assert writer.flush(timeout_s=30)
                assert stored_spans(store) == 30
                assert store.client.command("SELECT uniqExact(SpanId) FROM stagetrace.otel_traces") == 30
            finally:
                writer.close()
                writer.store.close()
        failures = [m for m in caplog.messages if "NOT_ENOUGH_SPACE" in m]
        assert len(failures) == 1 and "will retry" in failures[0], caplog.messages  # one line, not one per retry
        assert any("work again" in m for m in caplog.messages)
