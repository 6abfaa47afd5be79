"""TLS and basic auth on every listener (``--web-config-file``), against real clients: curl, Prometheus, the
OpenTelemetry SDK's OTLP exporters, clickhouse-connect and stagetrace's own commands. The CA and certificates are
made by the test (trustme); nothing is mocked."""

import importlib.util
import json
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import trustme

_spec = importlib.util.spec_from_file_location("agents", Path(__file__).parent / "agents.py")
agents = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agents)

HOSTS = ("127.0.0.1", "localhost")


@pytest.fixture
def pki(tmp_path, monkeypatch):
    """A CA, the agent's certificate (127.0.0.1, localhost), a client certificate, and where they are written.

    ``REQUESTS_CA_BUNDLE`` and ``CURL_CA_BUNDLE`` are unset: requests lets them override a session's CA file, so
    the OTLP/HTTP exporter's ``certificate_file`` is ignored where one is set (as on this machine)."""
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    ca = trustme.CA()
    files = tmp_path / "pki"
    files.mkdir()
    ca.cert_pem.write_to_path(files / "ca.crt")
    server = ca.issue_cert(*HOSTS)
    server.cert_chain_pems[0].write_to_path(files / "tls.crt")
    server.private_key_pem.write_to_path(files / "tls.key")
    client = ca.issue_cert("client@example.org")
    client.cert_chain_pems[0].write_to_path(files / "client.crt")
    client.private_key_pem.write_to_path(files / "client.key")
    return ca, files


def _web_config(files: Path, **tls) -> Path:
    path = files / "web.yml"
    settings = {"cert_file": "tls.crt", "key_file": "tls.key", **tls}  # relative: read from the file's folder
    path.write_text("tls_server_config:\n" + "".join(f"  {k}: {v}\n" for k, v in settings.items()))
    return path


def _curl(component, url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [component("curl", "curl"), "-sS", "--max-time", "20", *args, url], capture_output=True, text=True, timeout=60
    )


def _serial(address: str, port: int, ca: Path) -> int:
    """The serial number of the certificate the listener presents now (a new connection)."""
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection((address, port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=address) as tls,
    ):
        from cryptography import x509

        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_every_listener_speaks_tls_to_real_clients(pki, tmp_path, component, monkeypatch):
    ca, files = pki
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(files / "ca.crt"))  # the gRPC exporter's CA file
    agent = agents.Agent(tmp_path / "agent", "--web-config-file", str(_web_config(files)))
    try:
        endpoints = agent.endpoints
        assert all(endpoints[k].startswith("https://") for k in ("metrics", "otlp", "query")), endpoints
        # curl with the CA: /metrics answers; plain HTTP to the same port is refused, as is a client without the CA
        answer = _curl(component, endpoints["metrics"], "--cacert", str(files / "ca.crt"))
        assert answer.returncode == 0 and "rdma_port_state" in answer.stdout, answer.stderr
        plain = _curl(component, endpoints["metrics"].replace("https://", "http://"))
        assert plain.returncode != 0 or "rdma_port_state" not in plain.stdout
        assert _curl(component, endpoints["metrics"]).returncode == 60  # curl: the peer's certificate is not trusted

        # the OpenTelemetry SDK's OTLP exporters, HTTP and gRPC, with the CA file
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        exporters = {
            "http": HttpExporter(endpoint=f"{endpoints['otlp']}/v1/traces", certificate_file=str(files / "ca.crt")),
            "grpc": GrpcExporter(
                endpoint=f"https://localhost:{endpoints['otlp_grpc'].rsplit(':', 1)[1]}", insecure=False
            ),
        }
        for name, exporter in exporters.items():
            provider = TracerProvider(resource=Resource.create({"service.name": f"tls-{name}"}))
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            with provider.get_tracer("t").start_as_current_span(
                "request", attributes={"stagetrace.request.id": f"tls-{name}"}
            ):
                pass
            provider.shutdown()

        # clickhouse-connect with the CA reads the query endpoint; so does `stagetrace trace` through the agent
        import clickhouse_connect

        port = urllib.parse.urlsplit(endpoints["query"]).port
        client = clickhouse_connect.get_client(
            host="localhost", port=port, secure=True, verify=True, ca_cert=str(files / "ca.crt"), database="stagetrace"
        )
        deadline = time.monotonic() + 30
        while client.command("SELECT count() FROM stagetrace_requests WHERE startsWith(RequestId, 'tls-')") < 2:
            assert time.monotonic() < deadline, "the spans sent over TLS were not stored"
            time.sleep(0.5)
        traced = agents.stagetrace(
            "trace", "tls-grpc", "--json", "--store", agent.dsn, env={"STAGETRACE_CA_FILE": str(files / "ca.crt")}
        )
        assert traced.returncode == 0 and json.loads(traced.stdout)["request_id"] == "tls-grpc", traced.stderr
        untrusted = agents.stagetrace("trace", "tls-grpc", "--store", agent.dsn)
        assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        assert len(untrusted.stderr.strip().splitlines()) == 1, untrusted.stderr

        # Grafana's data source, provisioned for this agent: a verified TLS connection with the CA, read from its file
        provisioned = agents.stagetrace(
            "provision",
            "--to-dir",
            str(tmp_path / "grafana"),
            "--store",
            agent.dsn,
            env={"STAGETRACE_CA_FILE": str(files / "ca.crt")},
        )
        assert provisioned.returncode == 0, provisioned.stderr
        import yaml

        (source,) = yaml.safe_load((tmp_path / "grafana" / "datasources" / "stagetrace.yaml").read_text())[
            "datasources"
        ]
        assert source["jsonData"]["secure"] is True and source["jsonData"]["port"] == port
        assert (source["jsonData"]["tlsSkipVerify"], source["jsonData"]["tlsAuthWithCACert"]) == (False, True)
        assert source["secureJsonData"]["tlsCACert"] == f"$__file{{{files / 'ca.crt'}}}"
    finally:
        agent.stop()


def _grpc_credentials(files: Path, client: bool = False):
    import grpc

    return grpc.ssl_channel_credentials(
        (files / "ca.crt").read_bytes(),
        *(((files / "client.key").read_bytes(), (files / "client.crt").read_bytes()) if client else ()),
    )


def test_required_client_certificates_refuse_a_client_without_one(pki, tmp_path, component):
    ca, files = pki
    config = _web_config(files, client_auth_type="RequireAndVerifyClientCert", client_ca_file="ca.crt")
    # off loopback the query endpoint needs a token or client certificates: here the certificates are enough
    agent = agents.Agent(tmp_path / "agent", "--web-config-file", str(config), "--query-listen", "0.0.0.0:0")
    try:
        url = agent.endpoints["metrics"]
        refused = _curl(component, url, "--cacert", str(files / "ca.crt"))
        assert refused.returncode != 0 and "rdma_port_state" not in refused.stdout
        admitted = _curl(
            component,
            url,
            "--cacert",
            str(files / "ca.crt"),
            "--cert",
            str(files / "client.crt"),
            "--key",
            str(files / "client.key"),
        )
        assert admitted.returncode == 0 and "rdma_port_state" in admitted.stdout, admitted.stderr
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        target = f"localhost:{agent.endpoints['otlp_grpc'].rsplit(':', 1)[1]}"
        for client, ok in ((False, False), (True, True)):
            with grpc.secure_channel(target, _grpc_credentials(files, client)) as channel:
                stub = trace_service_pb2_grpc.TraceServiceStub(channel)
                try:
                    stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
                    assert ok, "a gRPC client without a certificate was let in"
                except grpc.RpcError as exc:
                    assert not ok, exc
    finally:
        agent.stop()


def test_prometheus_scrapes_over_https_with_basic_auth(pki, tmp_path, component):
    import bcrypt

    _, files = pki
    config = _web_config(files)
    hashed = bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=4)).decode()
    config.write_text(config.read_text() + f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    agent = agents.Agent(tmp_path / "agent", "--web-config-file", str(config))
    prometheus = None
    try:
        url = urllib.parse.urlsplit(agent.endpoints["metrics"])
        assert (
            _curl(
                component,
                agent.endpoints["metrics"],
                "--cacert",
                str(files / "ca.crt"),
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ).stdout
            == "401"
        )
        binary = component("prometheus", "prometheus")
        port = agents.free_port()
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: stagetrace\n    scheme: https\n"
            f"    tls_config: {{ca_file: {files / 'ca.crt'}}}\n"
            "    basic_auth: {username: prometheus, password: scrape-secret}\n"
            f"    static_configs: [{{targets: ['localhost:{url.port}']}}]\n"
        )
        prometheus = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        query = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="stagetrace"}'})
        deadline, up = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                result = json.loads(_curl(component, query).stdout)
                up = next((r["value"][1] for r in result["data"]["result"]), None)
            except (ValueError, KeyError):
                up = None
            if up == "1":
                break
            time.sleep(1)
        assert up == "1", (tmp_path / "prometheus.log").read_text()[-2000:]
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        agent.stop()


def test_a_certificate_replaced_during_a_stream_of_spans_loses_none(pki, tmp_path):
    """cert-manager replaces the certificate in place while a sender streams spans over OTLP/HTTP and gRPC: new
    connections get the new certificate without a restart, and every span sent is stored once."""
    ca, files = pki
    agent = agents.Agent(tmp_path / "agent", "--web-config-file", str(_web_config(files)))
    sent: list[str] = []
    stop = threading.Event()

    def stream():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        n = 0
        while not stop.is_set():  # a new exporter, so a new connection, each time: each sees the certificate then
            provider = TracerProvider()
            provider.add_span_processor(
                SimpleSpanProcessor(
                    OTLPSpanExporter(
                        endpoint=f"{agent.endpoints['otlp']}/v1/traces", certificate_file=str(files / "ca.crt")
                    )
                )
            )
            name = f"rotated-{n}"
            with provider.get_tracer("t").start_as_current_span(name, attributes={"stagetrace.request.id": name}):
                pass
            provider.shutdown()
            sent.append(name)
            n += 1

    try:
        port = urllib.parse.urlsplit(agent.endpoints["otlp"]).port
        before = _serial("127.0.0.1", port, files / "ca.crt")
        sender = threading.Thread(target=stream)
        sender.start()
        time.sleep(2)
        renewed = ca.issue_cert(*HOSTS)
        for name, pem in (("tls.key", renewed.private_key_pem), ("tls.crt", renewed.cert_chain_pems[0])):
            staged = files / f".{name}.new"
            pem.write_to_path(staged)
            staged.replace(files / name)  # as a mounted Secret changes: each file swapped whole
        deadline = time.monotonic() + 10
        while _serial("127.0.0.1", port, files / "ca.crt") == before:
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.2)
        time.sleep(2)
        stop.set()
        sender.join(timeout=60)
        assert len(sent) > 10
        import clickhouse_connect

        client = clickhouse_connect.get_client(
            host="localhost",
            port=urllib.parse.urlsplit(agent.endpoints["query"]).port,
            secure=True,
            ca_cert=str(files / "ca.crt"),
            database="stagetrace",
        )
        deadline = time.monotonic() + 30
        while True:
            stored = dict(
                client.query(
                    "SELECT SpanName, count() FROM otel_traces WHERE startsWith(SpanName, 'rotated-') GROUP BY SpanName"
                ).result_rows
            )
            if len(stored) >= len(sent) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(stored) == set(sent) and set(stored.values()) == {1}
    finally:
        stop.set()
        agent.stop()


@pytest.mark.parametrize(
    "content, says",
    [
        (
            "tls_server_config: {cert_file: tls.crt, key_file: tls.key, client_auth_type: RequireAnyClientCert}",
            "client_auth_type RequireAnyClientCert is not supported",
        ),
        ("tls_server_config: {cert_file: tls.crt, key_file: missing.key}", "cannot load the TLS certificate"),
        (
            "tls_server_config: {cert_file: tls.crt, key_file: tls.key, cipher_suites: [TLS_AES_128_GCM_SHA256]}",
            "cipher_suites cannot be set here",
        ),
        ("basic_auth_users: {prometheus: plaintext}", "must map each user to a bcrypt hash"),
    ],
)
def test_a_web_configuration_that_cannot_be_used_is_one_line(pki, tmp_path, content, says):
    _, files = pki
    (files / "web.yml").write_text(content + "\n")
    refused = agents.stagetrace(
        "agent",
        "--collectors",
        "",
        "--store",
        f"chdb://{tmp_path / 'store'}",
        "--web-config-file",
        str(files / "web.yml"),
        "--otlp",
        "none",
        "--otlp-grpc",
        "none",
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert says in refused.stderr and "Traceback" not in refused.stderr


def test_a_certificate_caught_half_written_is_not_taken_until_it_loads(pki, monkeypatch):
    """The listeners' context is built again when the files change; a certificate file caught mid-write does not
    load, so the previous pair keeps serving, and the new one is taken once it is whole."""
    from stagetrace import web_config

    ca, files = pki
    monkeypatch.setattr(web_config, "RELOAD_CHECK_S", 0.0)
    tls = web_config.WebConfig.load(_web_config(files)).tls
    first = tls.context()
    whole = ca.issue_cert(*HOSTS).cert_chain_pems[0].bytes()
    (files / "tls.crt").write_bytes(whole[: len(whole) // 2])
    assert tls.context() is first
    (files / "tls.crt").write_bytes(whole)  # the key does not match it yet: still the previous pair
    assert tls.context() is first
    renewed = ca.issue_cert(*HOSTS)
    renewed.private_key_pem.write_to_path(files / "tls.key")
    renewed.cert_chain_pems[0].write_to_path(files / "tls.crt")
    assert tls.context() is not first
