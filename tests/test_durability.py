"""The one write path (``exporters.durable``): rows the store can never take are isolated, not a whole batch lost.

Real chdb stores and real failures: a value clickhouse-connect cannot serialise into its column, and a table
renamed away (the store refusing every insert). Kill -9 tests of the processes that use this path are in
``tests/test_kill.py``.
"""

import logging

from stagetrace.exporters import spool
from stagetrace.exporters.clickhouse import METRIC_COLUMNS
from stagetrace.exporters.durable import DurableWriter

T0 = 1_700_000_000_000_000_000


def gauge_rows(n: int, poisoned: set[int] = frozenset()) -> list[tuple]:
    """``n`` gauge rows in the metric writer's layout; ``poisoned`` rows carry a value no Float64 column takes."""
    return [({"host.name": "node-a"}, "agent", "scope", "1", "gpu_temperature_celsius", "", "", {"gpu": str(i)}, 0,
             T0 + i, "not a number" if i in poisoned else float(i)) for i in range(n)]  # fmt: skip


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
