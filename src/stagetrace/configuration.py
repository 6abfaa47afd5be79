"""Configuration is evidence: an OpenTelemetry resource detector that records, once per process, what makes its
outputs reproducible or not (docs/design.md#configuration-is-evidence, docs/design.md#settings-that-change-numerics).

Registered under the SDK's ``opentelemetry_resource_detector`` entry point as ``stagetrace``, so any Python
process that builds its resource with ``Resource.create()`` (vLLM, SGLang, a LangChain or LlamaIndex app, the span
API) records it when started with ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=stagetrace``, without a line of code:

- the GPUs the process sees (``CUDA_VISIBLE_DEVICES`` resolved through NVML to UUIDs and models), the driver and
  CUDA versions, the NCCL version;
- the numerics-relevant environment (``NCCL_ALGO``, ``NCCL_PROTO``, ``VLLM_BATCH_INVARIANT``, ...);
- the serving engine, its version, and the settings that change numerics as its command line gives them
  (``--kv-cache-dtype``, ``--attention-backend``, ``--quantization``, ``--tensor-parallel-size``, ...).

The names are ``conventions.CONFIGURATION_*``. It never fails and never blocks the process: each part that cannot
be read (no NVML, no engine) is left out and said once at debug level. ``STAGETRACE_NVML_FIXTURE`` points it at
recorded NVML snapshots, as it does the collectors.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata
from pathlib import Path

from opentelemetry.sdk.resources import Resource, ResourceDetector

from stagetrace import conventions as cv
from stagetrace.environment_variables import STAGETRACE_NVML_FIXTURE

logger = logging.getLogger(__name__)


def _nvml(environ):
    """An open NVML source, as the collectors choose it (recorded snapshots when STAGETRACE_NVML_FIXTURE is set);
    raises where there is none."""
    from stagetrace import nvml  # pynvml, loaded only when the detector runs

    fixture = environ.get(STAGETRACE_NVML_FIXTURE)
    source = nvml.open_source(Path(fixture) if fixture else None, watch_xids=False)
    source.open()
    return source


def _visible(count: int, uuids: list[str], environ) -> list[int]:
    """The NVML indexes of the GPUs ``CUDA_VISIBLE_DEVICES`` lets the process see (indexes or UUID prefixes)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    seen = []
    for item in (part.strip() for part in value.split(",")):
        if item.isdigit() and int(item) < count:
            seen.append(int(item))
        elif item.startswith("GPU-"):
            seen += [i for i, uuid in enumerate(uuids) if uuid.startswith(item)][:1]
        else:  # CUDA stops at the first entry it cannot use
            break
    return seen


def gpu_attributes(environ=None) -> dict[str, str]:
    """The visible GPUs' UUIDs, models and count, the driver and CUDA versions; empty without NVML."""
    from stagetrace import nvml

    environ = os.environ if environ is None else environ
    try:
        source = _nvml(environ)
    except Exception as exc:  # no driver, no library, no GPU: the process records less
        logger.debug("no GPU configuration recorded: %s", exc)
        return {}
    try:
        count = source.device_count()
        uuids = [source.read(gpu, "nvmlDeviceGetUUID") for gpu in range(count)]
        visible = _visible(count, uuids, environ)
        models = [source.read(gpu, "nvmlDeviceGetName") for gpu in visible]
        out = {
            cv.CONFIGURATION_GPU_UUIDS: ",".join(uuids[gpu] for gpu in visible),
            cv.CONFIGURATION_GPU_MODEL: ", ".join(dict.fromkeys(models)),
            cv.CONFIGURATION_GPU_COUNT: len(visible),
        }
        names = {"driver_version": cv.CONFIGURATION_DRIVER, "cuda_version": cv.CONFIGURATION_CUDA}
        return out | {names[label]: value for label, value in nvml.driver_versions(source).items()}
    except Exception as exc:
        logger.debug("GPU configuration only in part: %s", exc)
        return {}
    finally:
        source.close()


def nccl_version(environ=None) -> str | None:
    """NCCL's version: from torch when the process has loaded it, else the NVIDIA containers' NCCL_VERSION."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            version = torch.cuda.nccl.version()
            return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:
        logger.debug("torch.cuda.nccl.version(): %s", exc)
    return (os.environ if environ is None else environ).get("NCCL_VERSION")


def engine_attributes(argv: list[str]) -> dict[str, str]:
    """The serving engine this process runs (from its command line), its version, and the settings its command line
    gives that change numerics."""
    line = " ".join(argv)
    engine = next((name for name, marks in cv.CONFIGURATION_ENGINES.items() if any(m in line for m in marks)), None)
    if engine is None:
        return {}
    out = {cv.CONFIGURATION_ENGINE: engine}
    try:
        out[cv.CONFIGURATION_ENGINE_VERSION] = metadata.version(engine)
    except metadata.PackageNotFoundError:
        pass
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        name = cv.CONFIGURATION_FLAGS.get(flag)
        if name is None:
            continue
        if not equals:  # "--flag value", or a switch
            following = argv[i + 1] if i + 1 < len(argv) else ""
            value = following if following and not following.startswith("--") else "true"
        out[f"{cv.CONFIGURATION_ENGINE}.{name}"] = value
    return out


def configuration(argv: list[str] | None = None, environ=None) -> dict[str, str | int]:
    """Everything the detector records for a process with this command line and environment (this process's by
    default)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str | int] = {}
    out.update(gpu_attributes(environ))
    nccl = nccl_version(environ)
    if nccl:
        out[cv.CONFIGURATION_NCCL] = nccl
    for name in cv.CONFIGURATION_ENVIRONMENT:
        if environ.get(name):
            out[f"{cv.CONFIGURATION_ENV_PREFIX}{name}"] = environ[name]
    out.update(engine_attributes(sys.argv if argv is None else argv))
    return out


class ConfigurationDetector(ResourceDetector):
    """The SDK's resource detector (entry point ``stagetrace``); never raises."""

    def detect(self) -> Resource:
        try:
            return Resource(configuration())
        except Exception as exc:  # a detector must not take the process down
            logger.debug("no configuration recorded: %s", exc)
            return Resource.get_empty()


__all__ = ["ConfigurationDetector", "configuration", "engine_attributes", "gpu_attributes"]
