"""Headroom before the edge (``exporters.diskspace``): the free-space reserve, measured on real filesystems.

A reserve larger than the filesystem the test's directory is on stands for a disk that is full: the agent's
receivers refuse exactly as for a full spool (HTTP 503 with Retry-After, gRPC UNAVAILABLE with RetryInfo), the
writer keeps batches out of the spool, the embedded engine's own guard refuses inserts (NOT_ENOUGH_SPACE), and
each state change is one log line. The disk really filled by another process: ``tests/test_disk_full.py``.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from tests.test_durability import gauge_rows, stored_gpus, trace_request
from tests.test_otlp_grpc import assert_retry_later, call, spans

from stagetrace.environment_variables import STAGETRACE_MIN_FREE_SPACE
from stagetrace.exporters import diskspace, spool
from stagetrace.exporters.clickhouse import METRIC_COLUMNS
from stagetrace.exporters.diskspace import Headroom, Reserve, parse_reserve, reserve_setting
from stagetrace.exporters.durable import DurableWriter, NoRoom
from stagetrace.exporters.otlp import TRACES, OtlpReceiver
from stagetrace.exporters.otlp_grpc import OtlpGrpcServer

GIB = 1 << 30


@pytest.mark.parametrize(
    "text, reserve",
    [
        ("512MiB", Reserve(512 << 20)),
        ("2GiB", Reserve(2 * GIB)),
        ("1000000", Reserve(1_000_000)),
        ("1.5 GB", Reserve(1_500_000_000)),
        ("5%", Reserve(fraction=0.05)),
        ("0.5 %", Reserve(fraction=0.005)),
        ("0", Reserve()),
    ],
)
def test_a_reserve_is_a_size_or_a_percentage(text, reserve):
    assert parse_reserve(text) == reserve


@pytest.mark.parametrize("text", ["lots", "-1GiB", "5 parsecs", "100%", "150%", ""])
def test_a_reserve_that_is_neither_says_how_to_write_it_in_one_line(text, monkeypatch):
    monkeypatch.setenv(STAGETRACE_MIN_FREE_SPACE, "1GiB")
    with pytest.raises(ValueError) as raised:
        parse_reserve(text)
    message = str(raised.value)
    assert "\n" not in message and ("512MiB" in message or "below 100" in message)
    if text:
        with pytest.raises(ValueError, match=r"^--min-free-space \(STAGETRACE_MIN_FREE_SPACE\): "):
            reserve_setting(text)


def test_the_flag_wins_over_the_environment_which_wins_over_the_default(monkeypatch):
    monkeypatch.delenv(STAGETRACE_MIN_FREE_SPACE, raising=False)
    assert reserve_setting() == diskspace.DEFAULT == Reserve(GIB, 0.05)
    monkeypatch.setenv(STAGETRACE_MIN_FREE_SPACE, "3%")
    assert reserve_setting() == Reserve(fraction=0.03)
    assert reserve_setting("256MiB") == Reserve(256 << 20)
    # the default: 1 GiB on a laptop's or a node's disk, 5% of a small volume
    assert diskspace.DEFAULT.of(2 << 40) == GIB and diskspace.DEFAULT.of(4 * GIB) == int(4 * GIB * 0.05)


def full(path) -> Reserve:
    """A reserve the filesystem under ``path`` cannot meet: it stands for that disk being full."""
    return Reserve(size=shutil.disk_usage(path).total * 2)


def test_below_the_reserve_requests_are_refused_and_counted_with_one_line_each_way(tmp_path, caplog):
    headroom = Headroom({"store": tmp_path / "store", "spool": tmp_path / "store.spool"}, full(tmp_path), every_s=0.05)
    assert [headroom.admit() for _ in range(200)] == [False] * 200
    assert headroom.refused == 200 and not headroom.room()
    assert "store and spool disk is full" in headroom.reason()  # one filesystem: named once, both said
    headroom.reserve = Reserve(size=1 << 20)  # room again (as if the other process freed its file)
    time.sleep(0.06)
    assert headroom.admit() and headroom.room()
    lines = [m for m in caplog.messages if "disk full" in m or "space back" in m]
    assert len(lines) == 2, caplog.messages
    assert lines[0].startswith("store and spool disk full (") and lines[0].endswith("refusing writes")
    assert lines[1].startswith("space back after ") and lines[1].endswith("accepting writes (refused 200 requests)")


def test_the_measurement_is_cached_not_made_per_request(tmp_path):
    headroom = Headroom({"spool": tmp_path}, Reserve(size=1), every_s=3600)
    assert headroom.admit()
    headroom.reserve = full(tmp_path)
    assert all(headroom.admit() for _ in range(1000))  # the next measurement is an hour away


def test_a_reserve_of_zero_checks_nothing(tmp_path):
    headroom = Headroom({"store": tmp_path}, parse_reserve("0"))
    assert headroom.off and headroom.admit() and headroom.engine_guard() == 0


def test_without_room_the_writer_refuses_requests_keeps_batches_out_of_the_spool_and_the_engine_refuses_inserts(
    store, caplog
):
    path = store.location.path
    headroom = Headroom({"store": path, "spool": f"{path}.spool"}, full(path), every_s=0.05)
    writer = DurableWriter(store, "metrics", headroom=headroom)
    try:
        with pytest.raises(NoRoom, match="disk is full"):
            writer.write_ahead(TRACES, trace_request(0), 3, spool.new_token())
        # a batch: the engine's own guard (half the reserve) refuses the insert, and the spool is not written
        assert headroom.engine_guard() == headroom.reserve.size // 2
        assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(10)) is False
        assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(10)) is False
        assert writer.spooled_rows() == 0 and writer.dropped_rows == 0 and stored_gpus(store) == []
        failures = [m for m in caplog.messages if "NOT_ENOUGH_SPACE" in m]
        assert len(failures) == 1 and "will retry" in failures[0]  # one line for the spell, not one per insert
        headroom.reserve = Reserve(size=1 << 20)
        time.sleep(0.06)
        assert writer.write("otel_metrics_gauge", METRIC_COLUMNS, gauge_rows(10))
        assert stored_gpus(store) == list(range(10))
        assert writer.write_ahead(TRACES, trace_request(1), 3, spool.new_token())
    finally:
        writer.close()


def test_the_receivers_answer_503_and_unavailable_with_retry_below_the_reserve_and_200_above(store, tmp_path):
    headroom = Headroom({"store": store.location.path}, full(store.location.path), every_s=0.05)
    core = OtlpReceiver(store, "127.0.0.1:0", headroom=headroom)
    server = OtlpGrpcServer(core, "127.0.0.1:0")
    body = encode_spans(spans(1)).SerializeToString()
    post = urllib.request.Request(
        f"{core.url}/v1/traces", data=body, method="POST", headers={"Content-Type": "application/x-protobuf"}
    )
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "2"
        assert b"disk is full" in refused.value.read()
        assert_retry_later(*call(server, body)[::2])
        assert headroom.refused == 2
        headroom.reserve = Reserve(size=1 << 20)
        time.sleep(0.06)
        with urllib.request.urlopen(post, timeout=10) as answer:
            assert answer.status == 200
        assert call(server, body)[0] is grpc.StatusCode.OK
        assert core.writer.flush()
        # two spans, taken once over each front-end (a request's token includes the front-end it came through)
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 4
    finally:
        server.close()
        core.close()


def test_the_check_costs_a_clock_read_per_request(tmp_path):
    """What a request pays for the reserve: measured, so that the README's figure is this test's."""
    headroom = Headroom({"store": tmp_path, "spool": tmp_path / "spool"}, Reserve(size=1))
    n = 200_000
    started = time.perf_counter()
    for _ in range(n):
        headroom.admit()
    per_request = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(1000):
        os.statvfs(tmp_path)
    per_statvfs = (time.perf_counter() - started) / 1000
    assert per_request < 20e-6, per_request  # microseconds, against milliseconds for the request itself
    print(f"admit: {per_request * 1e9:.0f} ns a request; statvfs: {per_statvfs * 1e9:.0f} ns")
