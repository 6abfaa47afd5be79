"""The kubernetes collector against real gRPC servers on unix sockets speaking the kubelet's PodResources API.

No kubelet runs where these tests run: the servers here answer over the real protocol (HTTP/2 gRPC on a
unix socket, service ``v1.PodResourcesLister``, the published messages) with recorded answers under
tests/fixtures/kubelet: an H200 node with 8 GPUs, and a one-GPU node whose device plugin shares the GPU
through MPS replicas ``<uuid>::0`` and ``<uuid>::1`` between two pods (its NVML snapshots and MPS control
answers are tests/fixtures/node's ``one-gpu-two-clients``). Servers that refuse, hang, or answer bytes
that are no PodResources message give SourceUnavailable or a counted error, never a crash.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, text_format
from prometheus_client.parser import text_string_to_metric_families
from stagetrace.collectors import build_node, kubernetes, podresources
from stagetrace.collectors.base import Node, Options, SourceUnavailable
from stagetrace.collectors.kubernetes import KubernetesCollector, diagnose, physical_id
from stagetrace.collectors.podresources import (
    AllocatableResourcesResponse,
    ContainerDevices,
    ContainerResources,
    GetPodResourcesRequest,
    ListPodResourcesResponse,
    PodResources,
    message_class,
)

from stagetrace.cli import main
from stagetrace.demo.hardware import NodeHardware
from tests.samples import by_name, scrape, series, value

KUBELET = Path(__file__).parent / "fixtures" / "kubelet"
NODE = Path(__file__).parent / "fixtures" / "node"
H200, SHARED = KUBELET / "h200-node", KUBELET / "one-gpu-mps"
ONE_GPU = "one-gpu-two-clients"
SHARED_UUID = "GPU-7e2b9d41-6a3c-4f18-8d05-b9c1e4a7f362"
H200_UUIDS = [g["nvmlDeviceGetUUID"] for g in json.loads((NODE / "nvml" / "nvml.json").read_text())["gpus"]]
SHARED_DIAGNOSIS = (
    f"{SHARED_UUID} is allocated 2 times (2 pods: batch/worker-0, voice/tts-0) with 2 MPS clients; "
    "the node advertises 2 nvidia.com/gpu devices for 1 physical GPU: the scheduler counts it twice"
)


@pytest.fixture
def socket_dir():
    """A short directory for sockets of the test's own servers (a unix socket's path is at most 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="k8s-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def shared_options(sock: Path, **more) -> Options:
    return Options(
        host="n1", kubelet_socket=sock, nvml_fixture=NODE / "nvml" / ONE_GPU, mps_fixture=NODE / "mps" / ONE_GPU, **more
    )


# ---------------------------------------------------------------------------------------------
# The messages: the published API's wire format


def test_descriptors_are_what_protoc_reads_from_api_proto():
    """The descriptors built at import from api.proto equal protoc's (scripts/podresources-descriptor)."""
    recorded = text_format.Parse((KUBELET / "api.descriptor.txtpb").read_text(), descriptor_pb2.FileDescriptorSet())
    assert [podresources.FILE] == list(recorded.file)
    assert podresources.parse_proto(podresources.PROTO.read_text()) == recorded.file[0]


def test_wire_format_is_the_published_apis():
    """Field numbers of kubernetes' podresources/v1/api.proto, as bytes on the wire (tag = number << 3 | type)."""
    assert PodResources(name="p", namespace="n", containers=[ContainerResources(name="c")]).SerializeToString() == (
        b"\x0a\x01p\x12\x01n\x1a\x03\x0a\x01c"
    )
    container = ContainerResources(
        name="c",
        devices=[ContainerDevices(resource_name="r", device_ids=["d"])],
        cpu_ids=[3],
        memory=[message_class("ContainerMemory")(memory_type="m", size=5)],
        dynamic_resources=[message_class("DynamicResource")(claim_name="x")],
    )
    assert container.SerializeToString() == (
        b"\x0a\x01c\x12\x06\x0a\x01r\x12\x01d\x1a\x01\x03\x22\x05\x0a\x01m\x10\x05\x2a\x03\x12\x01x"
    )
    topology = message_class("TopologyInfo")(nodes=[message_class("NUMANode")(ID=1)])
    assert ContainerDevices(topology=topology).SerializeToString() == b"\x1a\x04\x0a\x02\x08\x01"
    assert (
        AllocatableResourcesResponse(devices=[ContainerDevices(resource_name="r")], cpu_ids=[7]).SerializeToString()
        == b"\x0a\x03\x0a\x01r"
        b"\x12\x01\x07"
    )
    assert ListPodResourcesResponse(pod_resources=[PodResources(name="p")]).SerializeToString() == b"\x0a\x03\x0a\x01p"
    assert GetPodResourcesRequest(pod_name="p", pod_namespace="n").SerializeToString() == b"\x0a\x01p\x12\x01n"
    claim = message_class("ClaimResource")(
        cdi_devices=[message_class("CDIDevice")(name="v")], driver_name="d", pool_name="o", device_name="g"
    )
    assert claim.SerializeToString() == b"\x0a\x03\x0a\x01v\x12\x01d\x1a\x01o\x22\x01g"
    assert [podresources.method_path(m) for m in podresources.METHODS] == [
        "/v1.PodResourcesLister/List",
        "/v1.PodResourcesLister/GetAllocatableResources",
        "/v1.PodResourcesLister/Get",
    ]


def test_the_parser_refuses_what_it_does_not_read():
    with pytest.raises(podresources.ProtoSyntaxError, match="'map' is not read"):
        podresources.parse_proto("syntax = 'proto3'; package x; message M { map<string, string> m = 1; }")
    with pytest.raises(podresources.ProtoSyntaxError, match="unknown type Missing"):
        podresources.parse_proto("syntax = 'proto3'; package x; message M { Missing m = 1; }")


def test_replica_ids_resolve_to_the_physical_gpu():
    assert physical_id("GPU-7e2b::0") == physical_id("GPU-7e2b::13") == physical_id("GPU-7e2b") == "GPU-7e2b"
    assert physical_id("MIG-4f0e5d2a-1b3c-5d7e-9f11-23456789abcd") == "MIG-4f0e5d2a-1b3c-5d7e-9f11-23456789abcd"
    collector = KubernetesCollector(Options())
    assert [
        collector.is_gpu(r)
        for r in (
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            "nvidia.com/mig-1g.18gb",
            "rdma/hca_shared_devices_a",
            "amd.com/gpu",
        )
    ] == [True, True, True, False, False]
    assert KubernetesCollector(Options(gpu_resources=("amd.com/gpu",))).is_gpu("amd.com/gpu")


# ---------------------------------------------------------------------------------------------
# Recorded nodes, over the real protocol


def test_h200_node_each_gpu_once_and_who_holds_it(kubelet):
    options = Options(host="n1", kubelet_socket=kubelet(H200), nvml_fixture=NODE / "nvml", mps_fixture=NODE / "mps")
    node = build_node("gpu,mps,kubernetes", options)
    families = list(node.collect())
    node.close()
    result = by_name(families)
    assert value(result, "stagetrace_collector_success", collector="kubernetes") == 1
    assert [(lbl["resource"], v) for lbl, v in series(result, "k8s_gpu_allocatable_devices")] == [("nvidia.com/gpu", 8)]
    assert value(result, "k8s_gpu_physical_devices", resource="nvidia.com/gpu") == 8
    assert value(result, "k8s_gpu_allocated_devices", resource="nvidia.com/gpu") == 7  # GPU 7 is free
    held = {
        (lbl["uuid"], lbl["namespace"], lbl["pod"], lbl["container"])
        for lbl, _ in series(result, "k8s_gpu_allocation_info")
    }
    assert held == {
        *((u, "inference", "llama-70b-tp4-0", "vllm") for u in H200_UUIDS[:4]),
        *((u, "inference", "llama-8b-1", "vllm") for u in H200_UUIDS[4:6]),
        (H200_UUIDS[6], "rag", "embedder-5d8f9", "embedder"),
    }
    assert all(lbl["device_id"] == lbl["uuid"] for lbl, _ in series(result, "k8s_gpu_allocation_info"))
    per_gpu = {lbl["uuid"]: v for lbl, v in series(result, "k8s_gpu_allocations_per_physical")}
    assert per_gpu == {**dict.fromkeys(H200_UUIDS[:7], 1), H200_UUIDS[7]: 0}
    assert {lbl["uuid"] for lbl, _ in series(result, "gpu_up")} == set(per_gpu)  # the same GPUs NVML sees
    assert value(result, "k8s_gpu_sharing_factor") == 1
    assert {lbl["method"]: v for lbl, v in series(result, "k8s_podresources_errors_total")} == {
        "List": 0,
        "GetAllocatableResources": 0,
    }
    assert not any(lbl.get("resource", "").startswith("rdma/") for lbls in result.values() for lbl, _ in lbls)
    assert diagnose(families) is None


def test_one_gpu_shared_by_two_pods_through_mps_replicas(kubelet):
    """The node a scheduler reports as `used: 2, capacity: 1`: one GPU, two allocations, two MPS clients."""
    node = build_node("gpu,mps,kubernetes", shared_options(kubelet(SHARED)))
    families = list(node.collect())
    node.close()
    result = by_name(families)

    (gpu,) = series(result, "gpu_up")
    assert gpu[0]["uuid"] == SHARED_UUID  # how many physical GPUs: 1
    assert value(result, "k8s_gpu_allocatable_devices", resource="nvidia.com/gpu") == 2  # what the scheduler counts
    assert value(result, "k8s_gpu_physical_devices", resource="nvidia.com/gpu") == 1
    assert value(result, "k8s_gpu_allocated_devices", resource="nvidia.com/gpu") == 2
    assert value(result, "k8s_gpu_allocations_per_physical", uuid=SHARED_UUID) == 2  # allocations on it: 2
    assert value(result, "mps_clients", uuid=SHARED_UUID) == 2  # MPS clients on it: 2
    assert sorted(
        (lbl["namespace"], lbl["pod"], lbl["device_id"])
        for lbl, _ in series(result, "k8s_gpu_allocation_info", uuid=SHARED_UUID)
    ) == [("batch", "worker-0", f"{SHARED_UUID}::1"), ("voice", "tts-0", f"{SHARED_UUID}::0")]
    assert diagnose(families) == SHARED_DIAGNOSIS


def test_a_sharing_factor_that_matches_the_replicas_is_no_diagnosis(kubelet):
    node = build_node("gpu,mps,kubernetes", shared_options(kubelet(SHARED), gpu_sharing_factor=2))
    families = list(node.collect())
    node.close()
    assert diagnose(families) is None
    (factor,) = [s for f in families for s in f.samples if s.name == "k8s_gpu_sharing_factor"]
    assert factor.value == 2


def test_replicas_held_beyond_what_the_node_advertises(kubelet, tmp_path):
    """The device plugin restarted without its sharing config: it advertises the GPU once, the pods hold ::0 and ::1."""
    answers = podresources.load_answers(SHARED)
    del answers["GetAllocatableResources"].devices[1:]
    answers["GetAllocatableResources"].devices[0].device_ids[:] = [SHARED_UUID]
    podresources.write_answers(tmp_path, answers)
    node = build_node("gpu,mps,kubernetes", shared_options(kubelet(tmp_path)))
    families = list(node.collect())
    node.close()
    assert diagnose(families) == (
        f"{SHARED_UUID} is allocated 2 times (2 pods: batch/worker-0, voice/tts-0) with 2 MPS clients; "
        "the node allocated 2 nvidia.com/gpu devices and advertises 1: used: 2, capacity: 1"
    )


def test_collect_names_the_double_count_in_one_line_on_stderr(kubelet, capsys):
    sock = kubelet(SHARED)
    assert (
        main(
            [
                "collect",
                "--once",
                "--collectors",
                "gpu,mps,kubernetes",
                "--kubelet-socket",
                str(sock),
                "--nvml-fixture",
                str(NODE / "nvml" / ONE_GPU),
                "--mps-fixture",
                str(NODE / "mps" / ONE_GPU),
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"stagetrace: {SHARED_DIAGNOSIS}"]
    names = {f.name for f in text_string_to_metric_families(out)}  # stdout stays the exposition
    assert {"k8s_gpu_allocations_per_physical", "mps_clients", "gpu_up"} <= names


def test_the_demos_shared_node_shows_the_double_count(tmp_path):
    shared = NodeHardware("gpu-node-04", str(tmp_path), seed=7, shared_gpu=True)
    plain = NodeHardware("gpu-node-01", str(tmp_path), seed=7)
    try:
        line = diagnose(shared.scrape())
        assert line == (
            f"{shared.gpu_uuids[3]} is allocated 2 times (2 pods: rag-demo/worker-0, voice/tts-0) "
            "with 2 MPS clients; the node advertises 8 nvidia.com/gpu devices for 4 physical GPUs: "
            "the scheduler counts each twice"
        )
        assert diagnose(plain.scrape()) is None
    finally:
        shared.close()
        plain.close()


def test_the_recorded_kubelet_answers_get_from_list(kubelet):
    sock = kubelet(SHARED)
    channel = podresources.channel(sock)
    try:
        answer = podresources.call(
            channel, "Get", GetPodResourcesRequest(pod_name="tts-0", pod_namespace="voice"), timeout=2
        )
        assert answer.pod_resources.containers[0].devices[0].device_ids == [f"{SHARED_UUID}::0"]
        with pytest.raises(grpc.RpcError) as missing:
            podresources.call(channel, "Get", GetPodResourcesRequest(pod_name="x", pod_namespace="y"), timeout=2)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------------
# Enabled by default only on a Kubernetes node


def test_enabled_by_default_only_where_the_kubelets_socket_exists(kubelet, tmp_path):
    assert "kubernetes" not in [
        c.name for c in build_node(None, Options(kubelet_socket=tmp_path / "absent.sock")).collectors
    ]
    node = build_node(None, Options(kubelet_socket=kubelet(H200), nvml_fixture=NODE / "nvml"))
    assert "kubernetes" in [c.name for c in node.collectors]
    node.close()


def test_a_sharing_factor_below_one_is_refused(capsys):
    assert main(["collect", "--once", "--collectors", "kubernetes", "--gpu-sharing-factor", "0"]) == 2
    assert capsys.readouterr().err.strip() == "stagetrace: --gpu-sharing-factor: '0' is not a whole number of 1 or more"


# ---------------------------------------------------------------------------------------------
# A kubelet absent, refusing, hanging, or answering garbage


def test_no_socket_is_not_a_kubernetes_node(tmp_path, caplog):
    sock = tmp_path / "kubelet.sock"
    node = Node([KubernetesCollector(Options(kubelet_socket=sock))], host="n1")
    for _ in range(2):
        assert value(scrape(node), "stagetrace_collector_success", collector="kubernetes") == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"collector kubernetes: no kubelet PodResources socket at {sock} (not a Kubernetes node?)"
    ]


def test_a_file_that_is_no_socket(tmp_path):
    sock = tmp_path / "kubelet.sock"
    sock.write_text("not a socket\n")
    with pytest.raises(SourceUnavailable, match=r"List at .* failed: UNAVAILABLE"):
        KubernetesCollector(Options(kubelet_socket=sock)).collect(None)


class Switchable:
    """A PodResources server whose List and GetAllocatableResources answer as the test says at each call:
    the recorded answer, an abort with a status code, a delay, or bytes that are no message."""

    def __init__(self, sock: Path, answers: Path = SHARED):
        self.recorded = podresources.load_answers(answers)
        self.behaviour: dict[str, object] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {}
        for method in ("List", "GetAllocatableResources"):
            request_class, _ = podresources.METHODS[method]
            handlers[method] = grpc.unary_unary_rpc_method_handler(
                self._answer(method), request_deserializer=request_class.FromString, response_serializer=self._serialize
            )
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("v1.PodResourcesLister", handlers)])
        self.server.add_insecure_port(f"unix:{sock}")
        self.server.start()

    def _answer(self, method: str):
        def answer(request, context):
            how = self.behaviour.get(method)
            if isinstance(how, grpc.StatusCode):
                context.abort(how, f"{method} refused by the test")
            if isinstance(how, float):
                time.sleep(how)
            if how == "garbage":
                return b"\xff\xfe\x07 these bytes are no protobuf message"
            return self.recorded[method]

        return answer

    @staticmethod
    def _serialize(answer) -> bytes:
        return answer if isinstance(answer, bytes) else answer.SerializeToString()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def switchable(socket_dir):
    server = Switchable(socket_dir / "kubelet.sock")
    yield server, socket_dir / "kubelet.sock"
    server.stop()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED])
def test_a_kubelet_that_refuses_is_unavailable_and_counted(switchable, code, caplog):
    server, sock = switchable
    collector = KubernetesCollector(Options(kubelet_socket=sock))
    node = Node([collector], host="n1")
    server.behaviour["List"] = code
    with pytest.raises(SourceUnavailable, match=f"List at {sock} failed: {code.name}: List refused by the test"):
        collector.collect(None)
    assert value(scrape(node), "stagetrace_collector_success", collector="kubernetes") == 0
    assert f"failed: {code.name}" in caplog.records[-1].getMessage()
    server.behaviour.clear()  # the kubelet answers again: the failures are counted
    result = scrape(node)
    assert value(result, "stagetrace_collector_success", collector="kubernetes") == 1
    assert value(result, "k8s_podresources_errors_total", method="List") == 2
    assert value(result, "k8s_gpu_allocations_per_physical", uuid=SHARED_UUID) == 2


def test_garbage_in_place_of_an_answer_is_unavailable_not_a_crash(switchable):
    server, sock = switchable
    server.behaviour["List"] = "garbage"
    node = Node([KubernetesCollector(Options(kubelet_socket=sock))], host="n1")
    with pytest.raises(SourceUnavailable, match="List at .* failed: the answer is no List response"):
        node.collectors[0].collect(None)
    assert value(scrape(node), "stagetrace_collector_success", collector="kubernetes") == 0


def test_a_hanging_kubelet_does_not_hang_the_scrape(switchable, monkeypatch):
    server, sock = switchable
    monkeypatch.setattr(kubernetes, "CALL_TIMEOUT_S", 0.3)
    server.behaviour["List"] = 3.0
    node = Node([KubernetesCollector(Options(kubelet_socket=sock))], host="n1")
    started = time.monotonic()
    assert value(scrape(node), "stagetrace_collector_success", collector="kubernetes") == 0
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("how", [grpc.StatusCode.UNIMPLEMENTED, "garbage"])
def test_without_allocatable_resources_the_allocations_are_still_reported(switchable, how, caplog):
    """Kubelets before GetAllocatableResources answer UNIMPLEMENTED: allocations without the allocatable series."""
    server, sock = switchable
    server.behaviour["GetAllocatableResources"] = how
    node = Node([KubernetesCollector(Options(kubelet_socket=sock))], host="n1")
    for _ in range(2):
        result = scrape(node)
    assert value(result, "stagetrace_collector_success", collector="kubernetes") == 1
    assert series(result, "k8s_gpu_allocatable_devices") == [] and series(result, "k8s_gpu_physical_devices") == []
    assert value(result, "k8s_gpu_allocations_per_physical", uuid=SHARED_UUID) == 2
    assert value(result, "k8s_podresources_errors_total", method="GetAllocatableResources") == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "GetAllocatableResources" in warned[0]  # logged once, counted each time


def test_a_socket_that_answers_garbage_bytes_is_unavailable(socket_dir):
    """Not a gRPC server at all: whatever connects gets bytes that are no HTTP/2 and the connection closed."""
    sock = socket_dir / "kubelet.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen()
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n\x00\xff garbage")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        node = Node([KubernetesCollector(Options(kubelet_socket=sock))], host="n1")
        started = time.monotonic()
        assert value(scrape(node), "stagetrace_collector_success", collector="kubernetes") == 0
        assert time.monotonic() - started < 5
        with pytest.raises(SourceUnavailable, match="List at .* failed: UNAVAILABLE"):
            node.collectors[0].collect(None)
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_the_agent_logs_the_diagnosis_once_while_it_holds(kubelet, tmp_path):
    """The agent scrapes every interval; the one line is logged when it appears, not at every scrape."""
    import signal
    import subprocess
    import sys

    sock = kubelet(SHARED)
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--collectors",
            "gpu,mps,kubernetes",
            "--kubelet-socket",
            str(sock),
            "--nvml-fixture",
            str(NODE / "nvml" / ONE_GPU),
            "--mps-fixture",
            str(NODE / "mps" / ONE_GPU),
            "--store",
            f"chdb://{tmp_path / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "200ms",
            "--otlp",
            "none",
            "--otlp-grpc",
            "none",
            "--query-listen",
            "none",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    try:
        deadline = time.monotonic() + 60
        while "sampling every" not in log.read_text():  # serving: it has scraped once
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(2)  # ten more scrapes
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    text = log.read_text()
    assert text.count(SHARED_DIAGNOSIS) == 1, text
    assert f"stagetrace agent: {SHARED_DIAGNOSIS}" in text.splitlines()
