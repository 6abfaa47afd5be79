"""Property-based tests (hypothesis) for everything that parses input from outside: sysfs counters, MPS
control answers, ethtool statistic names, OTLP bodies. Each either yields well-formed values or the
module's own clean error, and never hangs (every example has a deadline)."""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import generate_latest

from stagetrace.collectors import ethtool, mps, rdma
from stagetrace.collectors.base import Options, Samples
from stagetrace.exporters import otlp
from stagetrace.exporters.prometheus import exposition
from stagetrace.exporters.rows import Resources, otlp_metric_rows, span_row

PROPS = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
U64 = (1 << 64) - 1

# --- sysfs counters -------------------------------------------------------------------------------------

counter_text = st.one_of(
    st.integers(0, U64).map(str),
    st.integers(U64 + 1, 10**4000).map(str),  # huge: no u64 counter prints this
    st.integers(-(10**6), -1).map(str),
    st.sampled_from(["", "N/A (no PMA)", "N/A", "0x10", "1_000", "12 34", "1e9", "٣", "nan", "\x00", "\ufffd"]),
    st.text(max_size=40),
)


@PROPS
@given(counter_text)
def test_a_counter_text_is_a_u64_or_nothing(text):
    value = rdma._number(text)
    if value is None:
        assert not (text.isascii() and text.isdigit() and int(text) <= U64)
    else:
        assert isinstance(value, int) and 0 <= value <= U64 and str(value) == text.lstrip("0").rjust(1, "0")


# a file's bytes, or what else a path under hw_counters/ may turn out to be when read
file_content = st.one_of(
    counter_text.map(lambda t: ("file", t.encode("utf-8", "surrogatepass"))),
    st.binary(max_size=64).map(lambda b: ("file", b)),
    st.just(("vanished", b"")),  # a dangling link: listed, then gone when opened
    st.just(("directory", b"")),  # EISDIR when read
)


@PROPS
@given(
    st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True), file_content, max_size=8),
    st.sampled_from(["4: ACTIVE", "", "garbage", "9999999999999999999999: X"]),
    st.sampled_from(["400 Gb/sec (4X NDR)", "", "fast", "nan Gb/sec", "1e400 Gb/sec"]),
)
def test_the_rdma_collector_survives_any_sysfs_contents(files, state, rate):
    root = Path(tempfile.mkdtemp())
    try:
        port = root / "class/infiniband/mlx5_0/ports/1"
        (port / "hw_counters").mkdir(parents=True)
        (port / "counters").mkdir()
        (port / "state").write_text(state)
        (port / "rate").write_text(rate)
        expected = {}
        for name, (kind, data) in files.items():
            path = port / "hw_counters" / name
            if kind == "file":
                path.write_bytes(data)
                text = data[:4096].decode("ascii", "replace").strip()
                if text.isascii() and text.isdigit() and int(text) <= U64 and name not in rdma._NOT_COUNTERS:
                    expected[rdma.hw_counter_spec(name).name] = int(text)
            elif kind == "vanished":
                os.symlink(root / "nowhere", path)
            else:
                path.mkdir()
        out = Samples()
        rdma.RdmaCollector(Options(sysfs=root, host="h")).collect(out)
        families = list(out.families("h"))
        got = {
            f.name + "_total": s.value
            for f in families
            for s in f.samples
            if f.type == "counter"
            and s.name.endswith("_total")
            and f.name.startswith("rdma_")
            and "port_" not in f.name
        }
        assert got == expected
        for family in families:
            for sample in family.samples:
                assert sample.value == sample.value and abs(float(sample.value)) != float("inf")
        exposition(families)  # what a scrape does with them: must not raise
    finally:
        shutil.rmtree(root)


# --- MPS control answers --------------------------------------------------------------------------------


class Answers:
    def __init__(self, answers: dict):
        self.answers = answers

    def ask(self, command: str) -> str:
        return self.answers.get(command.split()[0], "")


@PROPS
@given(st.text(max_size=200), st.text(max_size=60), st.text(max_size=200))
def test_any_mps_control_answer_gives_numbers_or_daemon_down(servers, percentage, clients):
    collector = mps.MpsCollector.__new__(mps.MpsCollector)  # the daemon half only: no NVML here
    collector.control = Answers(
        {"get_server_list": servers, "get_default_active_thread_percentage": percentage, "get_client_list": clients}
    )
    collector._said = {}
    out = Samples()
    collector._collect_daemon(out)
    values = {f.name: [s.value for s in f.samples] for f in out.families("h")}
    if values["mps_daemon_up"] == [1]:
        assert values["mps_servers"] == [len(mps._pids(servers))]
        (pct,) = values["mps_default_active_thread_percentage"]
        assert pct == pct and abs(pct) != float("inf")
    else:
        assert set(values) == {"mps_daemon_up"}


@PROPS
@given(st.lists(st.one_of(st.integers(0, 2**22).map(str), st.text(max_size=8)), max_size=20).map(" ".join))
def test_pids_are_the_ascii_decimal_tokens(output):
    assert mps._pids(output) == [int(t) for t in output.split() if re.fullmatch(r"[0-9]+", t)]


# --- ethtool statistic names ----------------------------------------------------------------------------


@PROPS
@given(st.binary(max_size=ethtool.ETH_GSTRING_LEN * 12))
def test_gstrings_are_one_nul_free_name_per_slot(raw):
    names = ethtool.gstrings(raw)
    assert len(names) == -(-len(raw) // ethtool.ETH_GSTRING_LEN)
    assert all("\0" not in n and len(n) <= ethtool.ETH_GSTRING_LEN for n in names)


@PROPS
@given(
    st.lists(
        st.one_of(
            st.from_regex(r"(rx|tx)_(prio[0-9]_pause(_duration)?|global_pause|discards_phy)", fullmatch=True),
            st.text(max_size=32),
        ),
        max_size=30,
        unique=True,
    ),
    st.integers(0, U64),
)
def test_any_statistic_name_gives_valid_series_or_none(names, value):
    collector = ethtool.EthtoolCollector.__new__(ethtool.EthtoolCollector)
    collector.include = re.compile(".")
    collector._plan, collector._included_names = {}, {}
    out = Samples()
    for name in names:
        planned = collector._planned(name)
        if planned is not None:
            out.add(planned[0], value * ethtool.SCALE.get(planned[0], 1), netdev="eth0", **planned[1])
    families = list(out.families("h"))
    assert all(METRIC_NAME.match(f.name) for f in families)
    generate_latest(type("R", (), {"collect": lambda self: families})())


# --- OTLP bodies ----------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=40,
)
OTLP_KEYS = [
    "resourceSpans",
    "scopeSpans",
    "spans",
    "traceId",
    "spanId",
    "parentSpanId",
    "name",
    "kind",
    "attributes",
    "key",
    "value",
    "stringValue",
    "intValue",
    "arrayValue",
    "values",
    "bytesValue",
    "kvlistValue",
    "startTimeUnixNano",
    "status",
    "code",
    "events",
    "links",
    "resource",
    "resourceMetrics",
    "scopeMetrics",
    "metrics",
    "gauge",
    "sum",
    "dataPoints",
    "asDouble",
    "asInt",
    "histogram",
]
otlp_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=34)
    | st.sampled_from(["5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(OTLP_KEYS), inner, max_size=6),
    max_leaves=60,
)


def decode_and_read(body: bytes, media: str):
    """What the receiver does with a body; only OtlpError may come out."""
    for message_class in (ExportTraceServiceRequest, ExportMetricsServiceRequest):
        try:
            message = otlp.decode(message_class(), body, media)
        except otlp.OtlpError as exc:
            assert exc.status == 400 and "\n" not in exc.message
            continue
        if message_class is ExportTraceServiceRequest:
            views, rejected = otlp.span_views(message)
            resources = Resources()
            rows = [span_row(v, resources) for v in views]
            assert len(rows) + rejected == sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
            assert otlp.span_counts(message) == (len(rows), rejected)  # what the receiver writes ahead
        else:
            stored, _, _ = otlp.metric_counts(message)
            assert stored == sum(len(rows) for rows in otlp_metric_rows(message).values())
        otlp.encode(message, media)


@PROPS
@given(st.binary(max_size=2000), st.sampled_from([otlp.PROTOBUF, otlp.JSON]))
def test_random_bytes_decode_or_give_a_clean_400(body, media):
    decode_and_read(body, media)


@PROPS
@given(
    st.one_of(json_values, otlp_like, st.dictionaries(st.sampled_from(["resourceSpans", "resourceMetrics"]), otlp_like))
)
def test_random_json_decodes_or_gives_a_clean_400(document):
    decode_and_read(json.dumps(document).encode(), otlp.JSON)


def _valid_protobuf() -> bytes:
    from tests.test_otlp import _vllm_protobuf  # the recorded vLLM request, as protobuf

    return _vllm_protobuf()


VALID_PROTOBUF = _valid_protobuf()


@PROPS
@given(st.binary(max_size=400))
def test_mutated_valid_protobuf_decodes_or_gives_a_clean_400(noise):
    body = bytearray(VALID_PROTOBUF)
    for i, b in enumerate(noise):  # overwrite, flip and cut: a truncated or corrupted body
        body[(i * 7919) % len(body)] ^= b
    decode_and_read(bytes(body[: len(body) - len(noise) % 5]), otlp.PROTOBUF)
