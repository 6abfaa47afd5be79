"""The configuration resource detector, through the OpenTelemetry SDK's own entry-point mechanism.

Each case runs a fresh Python process that builds its resource with ``Resource.create()`` as any instrumented
app does, with ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=stagetrace`` and a command line as vLLM's or SGLang's would
be. No GPU exists here: NVML answers from recorded snapshots in NVML's own shapes (``STAGETRACE_NVML_FIXTURE``), and
the case without them meets the real library failing to find a driver.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from stagetrace.collectors.nvml import gpu_snapshot, write_nvml_fixture

NODE_NVML = Path(__file__).parent / "fixtures" / "node" / "nvml"
BASE = {k: v for k, v in os.environ.items() if not k.startswith(("STAGETRACE_", "NCCL_", "CUDA_", "VLLM_", "OTEL_"))}


def resource(argv: list[str], **env: str) -> dict:
    script = (
        "import json, sys; sys.argv = json.loads(sys.argv[1]); "
        "from opentelemetry.sdk.resources import Resource; "
        "print(json.dumps(dict(Resource.create().attributes)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argv)],
        capture_output=True,
        text=True,
        env={**BASE, "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "stagetrace", **env},
        timeout=120,
    )
    assert done.returncode == 0 and not done.stderr, done.stderr
    return json.loads(done.stdout)


def test_a_vllm_process_records_its_gpus_versions_environment_and_settings():
    uuids = [g["nvmlDeviceGetUUID"] for g in json.loads((NODE_NVML / "nvml.json").read_text())["gpus"]]
    found = resource(
        [
            "/usr/local/bin/vllm",
            "serve",
            "Qwen/Qwen3-8B",
            "--kv-cache-dtype",
            "fp8",
            "--tensor-parallel-size=2",
            "--enable-prefix-caching",
            "--port",
            "8000",
        ],
        STAGETRACE_NVML_FIXTURE=str(NODE_NVML),
        CUDA_VISIBLE_DEVICES="2,3",
        NCCL_ALGO="Ring",
        NCCL_VERSION="2.21.5",
        VLLM_BATCH_INVARIANT="1",
    )
    assert {k: v for k, v in found.items() if not k.startswith(("telemetry.", "service."))} == {
        "gpu.uuids": f"{uuids[2]},{uuids[3]}",
        "gpu.model": "NVIDIA H200",
        "gpu.count": 2,
        "gpu.driver.version": "570.133.20",
        "cuda.driver.version": "12.8",
        "nccl.version": "2.21.5",
        "env.NCCL_ALGO": "Ring",
        "env.VLLM_BATCH_INVARIANT": "1",
        "engine": "vllm",
        "engine.kv_cache_dtype": "fp8",
        "engine.tensor_parallel_size": "2",
        "engine.enable_prefix_caching": "true",
    }


def test_an_sglang_process_on_gpus_named_by_uuid_with_the_cuda_version(tmp_path):
    gpus = [
        gpu_snapshot(f"GPU-{i}aaaaaaa-0000-4000-8000-00000000000{i}", name)
        for i, name in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H200"])
    ]
    write_nvml_fixture(tmp_path, gpus, nvmlSystemGetDriverVersion="550.54.15", nvmlSystemGetCudaDriverVersion=12040)
    found = resource(
        ["python", "-m", "sglang.launch_server", "--attention-backend", "fa3", "--tp", "2"],
        STAGETRACE_NVML_FIXTURE=str(tmp_path),
        CUDA_VISIBLE_DEVICES="GPU-0aaa,GPU-2aaa",
    )
    assert found["gpu.uuids"] == f"{gpus[0]['nvmlDeviceGetUUID']},{gpus[2]['nvmlDeviceGetUUID']}"
    assert (found["gpu.model"], found["gpu.count"]) == ("NVIDIA H100 80GB HBM3, NVIDIA H200", 2)
    assert (found["gpu.driver.version"], found["cuda.driver.version"]) == ("550.54.15", "12.4")
    assert (found["engine"], found["engine.attention_backend"], found["engine.tensor_parallel_size"]) == (
        "sglang",
        "fa3",
        "2",
    )


def test_without_a_driver_it_records_less_and_says_nothing():
    """The real NVML library, on a machine without an NVIDIA driver: the process starts as usual, without GPU
    attributes and without a word on stderr (resource() checks it); what needs no GPU is still recorded."""
    found = resource(["app.py"], NCCL_PROTO="Simple")
    assert not any(k.startswith(("gpu.", "cuda.", "engine")) for k in found), found
    assert found["env.NCCL_PROTO"] == "Simple"


def test_an_nvml_that_fails_after_opening_takes_nothing_down(tmp_path):
    write_nvml_fixture(tmp_path, [{"nvmlDeviceGetHandleByIndex": "NVMLError_GpuIsLost"}])
    found = resource(["app.py"], STAGETRACE_NVML_FIXTURE=str(tmp_path), NCCL_ALGO="Tree")
    assert "gpu.model" not in found and found["env.NCCL_ALGO"] == "Tree"
