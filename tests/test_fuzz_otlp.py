"""Fuzzing the OTLP endpoint of a running ``stagetrace agent`` over HTTP with hypothesis.

Random bodies (bytes, JSON, corrupted valid protobuf, compressed or not, truncated), content types,
encodings, lengths and paths. Every answer must be a 2xx/4xx or 503 within the client's time-out (no
crash, no hang); afterwards the agent still takes a valid request, still serves /metrics, and exits 0 on
SIGTERM without a traceback. ``STAGETRACE_FUZZ_EXAMPLES`` sets the number of requests (default 150).
"""

import gzip
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
EXAMPLES = int(os.environ.get("STAGETRACE_FUZZ_EXAMPLES", "150"))
ANSWERS = {200, 400, 404, 405, 411, 413, 415, 503}
SPAN = {
    "traceId": "5b8efff798038103d269b633813fc60c",
    "spanId": "eee19b7ec3c1b174",
    "name": "fuzz",
    "startTimeUnixNano": "1",
    "endTimeUnixNano": "2",
}


def _valid_protobuf() -> bytes:
    from tests.test_otlp import _vllm_protobuf

    return _vllm_protobuf()


VALID = _valid_protobuf()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-agent")
    log = tmp / "agent.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--store",
            f"chdb://{tmp / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "1s",
            "--otlp",
            "127.0.0.1:0",
            "--otlp-grpc",
            "127.0.0.1:0",
            "--query-listen",
            "none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env={**os.environ, "STAGETRACE_HOST": "fuzz"},
    )
    deadline = time.monotonic() + 60
    while not (found := re.search(r"receiving OTLP/HTTP at http://([\d.]+):(\d+)/v1", log.read_text())):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    metrics = re.search(r"serving (http://\S+/metrics)", log.read_text())[1]
    yield {"process": process, "host": found[1], "port": int(found[2]), "metrics": metrics, "log": log}
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def _json_body(value) -> bytes:
    return json.dumps(value).encode()


json_docs = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "attributes",
                    "key",
                    "value",
                    "traceId",
                    "spanId",
                    "arrayValue",
                    "values",
                    "resourceMetrics",
                    "gauge",
                    "dataPoints",
                ]
            )
            | st.text(max_size=8),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)
corrupted = st.binary(min_size=1, max_size=64).map(
    lambda noise: bytes(b ^ noise[i % len(noise)] if i % 13 == 0 else b for i, b in enumerate(VALID))
)
huge_attribute = st.integers(1, 4).map(
    lambda n: _json_body(
        {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    **SPAN,
                                    "attributes": [
                                        {"key": f"k{i}", "value": {"stringValue": "v" * (10**n)}}
                                        for i in range(10**n // 10 + 1)
                                    ],
                                }
                            ]
                        }
                    ]
                }
            ]
        }
    )
)
bodies = st.one_of(
    st.binary(max_size=4096),
    json_docs.map(_json_body),
    corrupted,
    huge_attribute,
    st.just(VALID),
    st.just(VALID[: len(VALID) // 2]),
    st.just(_json_body({"resourceSpans": [{"scopeSpans": [{"spans": [SPAN]}]}]})),
)
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


def sometimes(usual, odd):
    """``odd`` one time in five: one_of alone would draw each half the time."""
    return st.one_of(usual, usual, usual, usual, odd)


requests = st.fixed_dictionaries(
    {
        "body": bodies,
        # mostly what the receiver serves, so most requests reach the decoder rather than a 404/405/415
        "path": st.sampled_from(
            ["/v1/traces"] * 5
            + ["/v1/metrics"] * 4
            + ["/v1/logs"] * 3
            + ["/v1/traces/", "/v1/profiles", "/", "/v1/traces?x=%00"]
        ),
        "method": st.sampled_from(["POST"] * 15 + ["GET", "PUT"]),
        "content_type": sometimes(
            st.sampled_from(
                ["application/x-protobuf"] * 8
                + ["application/json"] * 8
                + ["application/json; charset=utf-8", "text/plain", ""]
            ),
            header_text,
        ),
        # "match": the header names the compression the body really has (None for none)
        "encoding": sometimes(
            st.sampled_from(["match"] * 8 + [None, "gzip", "deflate", "identity", "br"]), header_text
        ),
        "compress": st.sampled_from([None, "gzip", "deflate", "truncated-gzip"]),
        "length": st.sampled_from(["exact", "exact", "exact", "missing", "short", "bogus"]),
    }
)


def _send(agent, r: dict) -> int:
    body = r["body"]
    if r["compress"] == "gzip":
        body = gzip.compress(body)
    elif r["compress"] == "deflate":
        body = zlib.compress(body)
    elif r["compress"] == "truncated-gzip":
        body = gzip.compress(body)[:-5]
    conn = http.client.HTTPConnection(agent["host"], agent["port"], timeout=15)
    try:
        conn.putrequest(r["method"], r["path"], skip_accept_encoding=True)
        if r["content_type"]:
            conn.putheader("Content-Type", r["content_type"])
        encoding = (
            {"truncated-gzip": "gzip"}.get(r["compress"], r["compress"]) if r["encoding"] == "match" else r["encoding"]
        )
        if encoding:
            conn.putheader("Content-Encoding", encoding)
        if r["length"] == "exact":
            conn.putheader("Content-Length", str(len(body)))
        elif r["length"] == "short":  # announces more than it sends, then waits: the server must not wait for it
            conn.putheader("Content-Length", str(len(body) + 10))
        elif r["length"] == "bogus":
            conn.putheader("Content-Length", "-1" if len(body) % 2 else "12abc")
        conn.endheaders(body)
        if r["length"] == "short":
            conn.sock.shutdown(1)  # half-close: the body ends early, as a crashed sender's would
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_otlp_endpoint_survives_fuzzing(agent):
    statuses: dict[int, int] = {}
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )
    @given(requests)
    def one(r):
        status = _send(agent, r)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in ANSWERS, (status, r)
        assert agent["process"].poll() is None

    one()
    elapsed = time.monotonic() - started
    print(f"\nfuzz: {sum(statuses.values())} requests in {elapsed:.1f} s, answers {dict(sorted(statuses.items()))}")
    # still serving: a valid request is taken, /metrics answers
    valid = {
        "body": VALID,
        "path": "/v1/traces",
        "method": "POST",
        "content_type": "application/x-protobuf",
        "encoding": None,
        "compress": None,
        "length": "exact",
    }
    assert _send(agent, valid) == 200
    with urllib.request.urlopen(agent["metrics"], timeout=10) as response:
        assert b"stagetrace_collector_success" in response.read()
    agent["process"].send_signal(signal.SIGTERM)
    assert agent["process"].wait(timeout=60) == 0
    log = agent["log"].read_text()
    assert "Traceback" not in log, log[-3000:]
