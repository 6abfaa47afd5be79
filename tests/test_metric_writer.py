"""ClickHouseMetricWriter: the node's families as otel_metrics_gauge / otel_metrics_sum rows in the real embedded store."""

from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from stagetrace import schema
from stagetrace.collectors.base import Node, Options
from stagetrace.collectors.rdma import RdmaCollector
from stagetrace.exporters.clickhouse import ClickHouseMetricWriter
from stagetrace.exporters.rows import node_metric_rows

SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z in ns


def rdma_families():
    return list(Node([RdmaCollector(Options(sysfs=SYSFS, host="node-a"))], "node-a").collect())


def rows_by_name(store, table: str) -> dict:
    query = (
        f"SELECT *, toUnixTimestamp64Nano(TimeUnix) AS ns FROM stagetrace.{table} WHERE Attributes['device'] = 'mlx5_3'"
    )
    return {r["MetricName"]: r for r in store.client.query(query).named_results()}


def test_counters_are_cumulative_monotonic_sums_and_the_rest_gauges(store):
    writer = ClickHouseMetricWriter(store, host="node-a")
    assert writer.write(rdma_families(), time_ns=T0)
    sums, gauges = rows_by_name(store, "otel_metrics_sum"), rows_by_name(store, "otel_metrics_gauge")
    sent = sums["rdma_port_transmit_bytes_total"]
    words = int((SYSFS / "class/infiniband/mlx5_3/ports/1/counters/port_xmit_data").read_text())
    assert sent["Value"] == 4 * words
    assert (sent["IsMonotonic"], sent["AggregationTemporality"]) == (True, 2)
    assert sent["Attributes"] == {"device": "mlx5_3", "port": "1"}
    assert sent["ResourceAttributes"] == {"host.name": "node-a", "service.name": "stagetrace-agent"}
    assert sent["ServiceName"] == "stagetrace-agent" and sent["ns"] == T0
    assert sent["MetricDescription"].startswith("Data bytes transmitted")
    assert sums["rdma_local_ack_timeout_err_total"]["Value"] == 131
    assert gauges["rdma_port_state"]["Value"] == 4
    assert gauges["rdma_port_info"]["Value"] == 1
    assert gauges["rdma_port_info"]["Attributes"] == {
        "device": "mlx5_3",
        "port": "1",
        "netdev": "ens2f1np1",
        "link_layer": "Ethernet",
        "fw_ver": "28.39.2048",
        "hca_type": "MT4129",
        "rail": "mlx5_3/1",
    }
    assert "rdma_port_state" not in sums and "rdma_port_transmit_bytes_total" not in gauges
    success = store.client.command(
        "SELECT Value FROM stagetrace.otel_metrics_gauge WHERE MetricName = {n:String} AND Attributes['collector'] = 'rdma'",
        parameters={"n": "stagetrace_collector_success"},
    )
    assert success == 1


def test_unit_is_taken_from_the_family_and_created_samples_are_left_out():
    family = CounterMetricFamily("nic_bytes_total", "Bytes.", labels=["host", "netdev"], unit="bytes", created=1.0)
    family.add_metric(["node-a", "eth0"], 10, created=1.0)
    rows = node_metric_rows([family], "node-a", T0, start_ns=T0 - 5)
    (row,) = rows["otel_metrics_sum"]
    assert row[4:7] == ("nic_bytes_total", "Bytes.", "bytes")
    assert row[8:11] == (T0 - 5, T0, 10.0)
    assert rows["otel_metrics_gauge"] == []


def test_rows_are_held_while_the_store_fails_and_written_when_it_works_again(store, caplog):
    writer = ClickHouseMetricWriter(store, host="node-a")
    families = rdma_families()
    per_write = len(node_metric_rows(families, "node-a", T0)["otel_metrics_sum"])
    (sum_ddl,) = [s for s in schema.statements() if "`otel_metrics_sum`" in s]
    store.client.command("DROP TABLE stagetrace.otel_metrics_sum")  # a real failure: the table is gone
    assert not writer.write(families, time_ns=T0)
    assert not writer.write(families, time_ns=T0 + 1)
    assert writer.held_rows == 2 * per_write  # gauges went in; the sums wait
    failures = [m for m in caplog.messages if m.startswith("cannot insert")]
    assert len(failures) == 1 and "will retry" in failures[0]
    store.client.command(sum_ddl)
    assert writer.write(families, time_ns=T0 + 2)
    assert writer.held_rows == 0
    count = store.client.command("SELECT count() FROM stagetrace.otel_metrics_sum")
    assert count == 3 * per_write
    assert any(m.startswith("inserts into") and "work again" in m for m in caplog.messages)


def test_samples_are_inserted_on_their_own_cadence_and_close_inserts_what_is_held(store):
    """``insert_every_s``: the first sample at once, later ones held until an insert is due (or ``insert_rows``
    are held); while held, ``write`` answers with the last insert's outcome, and ``close`` inserts what is held."""
    families = rdma_families()
    sums = len(node_metric_rows(families, "node-a", T0)["otel_metrics_sum"])
    count = "SELECT count() FROM stagetrace.otel_metrics_sum"
    writer = ClickHouseMetricWriter(store, host="node-a", insert_every_s=3600, insert_rows=2 * sums)
    assert writer.write(families, time_ns=T0)
    assert store.client.command(count) == sums  # the first sample at once
    assert writer.write(families, time_ns=T0 + 1)
    assert store.client.command(count) == sums and writer.held_rows > sums  # held: not due, below insert_rows
    assert writer.write(families, time_ns=T0 + 2)  # the third sample brings the sums to insert_rows
    assert store.client.command(count) == 3 * sums and writer.held_rows == 0
    assert writer.write(families, time_ns=T0 + 3)
    (sum_ddl,) = [s for s in schema.statements() if "`otel_metrics_sum`" in s]
    store.client.command("DROP TABLE stagetrace.otel_metrics_sum")
    writer.insert_every_s = 0
    assert not writer.write(families, time_ns=T0 + 4)  # due, and the store fails
    writer.insert_every_s = 3600
    assert not writer.write(families, time_ns=T0 + 5)  # not due: the last insert's outcome, not a success
    store.client.command(sum_ddl)
    assert writer.close()
    assert store.client.command(count) == 3 * sums  # held through the failure, inserted by close


def test_held_rows_are_bounded_by_dropping_the_oldest(store):
    families = rdma_families()
    per_write = len(node_metric_rows(families, "node-a", T0)["otel_metrics_sum"])
    # in memory, without a spool (with one, the spool's byte bound applies: tests/test_spool.py)
    writer = ClickHouseMetricWriter(store, host="node-a", max_held_rows=per_write + 10, spool_dir=False)
    store.client.command("DROP TABLE stagetrace.otel_metrics_sum")
    for i in range(3):
        writer.write(families, time_ns=T0 + i)
    assert writer.held_rows == per_write + 10
    assert writer.dropped_rows == 2 * per_write - 10
    assert {row[9] for row in writer._held["otel_metrics_sum"]} == {T0 + 1, T0 + 2}  # the newest survive


def test_close_writes_and_closes_a_store_it_opened(store_dsn):
    writer = ClickHouseMetricWriter(store_dsn, host="node-a")
    assert writer.write(rdma_families(), time_ns=T0)
    assert writer.close()
    from stagetrace.store import open_store

    with open_store(store_dsn) as store:
        assert (
            store.client.command(
                "SELECT count() FROM stagetrace.otel_metrics_sum WHERE MetricName = 'rdma_link_downed_total'"
            )
            == 8
        )


def test_a_nodes_samples_make_the_same_rows_as_its_families(kubelet):
    """The agent writes ``Node.collect_samples()`` as they are, without client_python's families: every collector
    of the fixture node (counters with units, gauges, info metrics with their own labels) gives the same rows."""
    from stagetrace.collectors import build_node

    fixture = SYSFS.parent
    options = Options(
        sysfs=SYSFS,
        host="node-a",
        nvml_fixture=fixture / "nvml",
        mps_fixture=fixture / "mps",
        nccl_dir=fixture / "nccl",
        ethtool_fixture=fixture / "ethtool" / "statistics.json",
        kubelet_socket=kubelet(fixture.parent / "kubelet" / "h200-node"),
    )
    node = build_node("gpu,mps,rdma,ethtool,nccl,kubernetes", options)
    scraped = node.collect_samples()
    node.close()
    families = [f for samples in scraped for f in samples.families("node-a")]
    by_samples, by_families = node_metric_rows(scraped, "node-a", T0), node_metric_rows(families, "node-a", T0)

    def key(row):  # the rows' attributes are dicts: compare them as sorted items
        return tuple(sorted(v.items()) if isinstance(v, dict) else v for v in row)

    for table in by_families:
        assert sorted(map(key, by_samples[table])) == sorted(map(key, by_families[table]))
    names = {row[4] for rows in by_samples.values() for row in rows}
    assert {
        "gpu_utilization_ratio",
        "rdma_port_info",
        "k8s_gpu_allocation_info",
        "stagetrace_collector_success",
    } <= names
    assert len(by_samples["otel_metrics_sum"]) > 100 and len(by_samples["otel_metrics_gauge"]) > 100
