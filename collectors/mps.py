"""MPS collector: the CUDA MPS control daemon, its servers, and its clients on each GPU.

Two sources, each behind a seam:

- The control daemon, asked through ``nvidia-cuda-mps-control`` (``echo <command> |
  nvidia-cuda-mps-control`` with ``CUDA_MPS_PIPE_DIRECTORY`` = ``Options.mps_pipe_dir``), each
  command under a timeout so a hanging binary cannot hang the scrape (:class:`BinaryControl`); or
  recorded answers (:class:`RecordedControl`): ``<Options.mps_fixture>/nvidia-cuda-mps-control.json``
  (or that JSON file itself) mapping each command line to its stdout, ``null`` for a command the
  daemon did not answer; an empty object is a host whose daemon is not running::

      {"get_server_list": "4242\\n", "get_client_list 4242": "5101\\n5102\\n",
       "get_default_active_thread_percentage": "50.0\\n"}

- NVML, through the gpu collector's source seam (``nvml.json`` snapshots hold the same calls):
  ``nvmlDeviceGetMPSComputeRunningProcesses`` gives each GPU's MPS clients and their memory,
  ``nvmlDeviceGetProcessUtilization`` their SM utilization.

``mps_clients{gpu,uuid}`` is one series per GPU, so a GPU shared by two MPS clients is counted once
as a device with 2 clients. A scheduler that reports a one-GPU node as ``used: 2, capacity: 1`` is
counting those clients as devices: ``count(gpu_up) == 1`` while ``mps_clients == 2`` shows it.

Absent MPS: no ``nvidia-cuda-mps-control`` on PATH and no pipe directory → SourceUnavailable (not
an MPS host). With the binary but no daemon (no ``control`` pipe, or no answer in time) →
``mps_daemon_up 0``, not a failure: that is the state operators alert on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Protocol

from stagetrace.collectors.base import (
    GAUGE,
    Collector,
    MetricSpec,
    Options,
    Samples,
    Setting,
    SourceUnavailable,
    path_or_none,
    register,
)
from stagetrace.collectors.nvml import (
    NVML_ERRORS,
    NVML_FIXTURE,
    CachedReads,
    NvmlSource,
    error_name,
    nvml_source,
    write_json_atomic,
)
from stagetrace.environment_variables import STAGETRACE_MPS_FIXTURE

logger = logging.getLogger("stagetrace.collectors.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
RECORDED_ANSWERS = f"{CONTROL_BINARY}.json"
CONTROL_TIMEOUT_S = 2.0

DAEMON_UP = MetricSpec("mps_daemon_up", GAUGE, "Whether the MPS control daemon answers on its control pipe.")
SERVERS = MetricSpec("mps_servers", GAUGE, "MPS server instances the control daemon runs (get_server_list).")
SERVER_CLIENTS = MetricSpec(
    "mps_server_clients",
    GAUGE,
    "Client processes connected to the MPS server with this PID (get_client_list).",
    ("pid",),
)
# Kept in percent: it mirrors the setting of the same name (set_default_active_thread_percentage).
DEFAULT_ACTIVE_THREAD_PERCENTAGE = MetricSpec(
    "mps_default_active_thread_percentage", GAUGE, "Share of SMs a new MPS server's clients may use, in percent."
)
GPU_LABELS = ("gpu", "uuid")
CLIENTS = MetricSpec(
    "mps_clients",
    GAUGE,
    "MPS client processes on the GPU: one series per device, however many clients share it.",
    GPU_LABELS,
)
CLIENT_MEMORY = MetricSpec(
    "mps_client_memory_used_bytes", GAUGE, "Device memory used by an MPS client process.", (*GPU_LABELS, "pid"), "bytes"
)
CLIENT_SM_UTILIZATION = MetricSpec(
    "mps_client_sm_utilization_ratio",
    GAUGE,
    "SM utilization of an MPS client process since the last scrape (NVML samples).",
    (*GPU_LABELS, "pid"),
    "ratio",
)

# The NVML readings this collector makes (record_nvml_fixture records them too).
NVML_CALLS = (("nvmlDeviceGetMPSComputeRunningProcesses",), ("nvmlDeviceGetProcessUtilization",))


class ControlUnanswered(Exception):
    """The control daemon gave no usable answer; the message says why."""


class NoDaemon(ControlUnanswered):
    """No control daemon runs (no control pipe): normal on a GPU host that does not use MPS."""


class MpsControl(Protocol):
    def ask(self, command: str) -> str:
        """The daemon's stdout for one command line; ControlUnanswered if it did not answer,
        SourceUnavailable if MPS does not exist on this host."""


class BinaryControl:
    """The real control daemon, through ``nvidia-cuda-mps-control`` on PATH."""

    def __init__(self, pipe_dir: Path, timeout: float = CONTROL_TIMEOUT_S):
        self.pipe_dir = Path(pipe_dir)
        self.timeout = timeout

    def ask(self, command: str) -> str:
        binary = shutil.which(CONTROL_BINARY)
        if binary is None:
            if not self.pipe_dir.exists():
                raise SourceUnavailable(
                    f"no CUDA MPS here: {CONTROL_BINARY} is not on PATH and {self.pipe_dir} does not exist"
                )
            raise SourceUnavailable(f"{self.pipe_dir} exists but {CONTROL_BINARY} is not on PATH to ask the daemon")
        control = self.pipe_dir / "control"
        if not control.exists():
            raise NoDaemon(f"no MPS control daemon: {control} does not exist")
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}
        # Own session, so a timeout kills whatever the binary started too.
        with subprocess.Popen(
            [binary],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",  # a garbled answer is reported as unexpected, not raised as UnicodeDecodeError
            env=env,
            start_new_session=True,
        ) as proc:
            try:
                stdout, stderr = proc.communicate(command + "\n", timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise ControlUnanswered(
                    f"{CONTROL_BINARY} did not answer `{command}` within {self.timeout:g}s"
                ) from None
        if proc.returncode != 0:
            why = (stderr or stdout).strip().splitlines()
            raise ControlUnanswered(f"`{command}` failed (exit {proc.returncode}){': ' + why[0] if why else ''}")
        return stdout


class RecordedControl:
    """Recorded ``nvidia-cuda-mps-control`` answers (module docstring), read again at each question."""

    def __init__(self, path: Path):
        path = Path(path)
        self.path = path / RECORDED_ANSWERS if path.is_dir() else path

    def ask(self, command: str) -> str:
        try:
            answers = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise SourceUnavailable(f"no recorded MPS answers at {self.path}") from None
        if answers.get(command) is None:
            raise ControlUnanswered(f"no MPS control daemon answer to `{command}` (recorded)")
        return answers[command]


def write_mps_fixture(directory: Path | str, answers: dict[str, str | None]) -> Path:
    """Write (atomically replace) recorded control answers: command line → stdout (None: no answer)."""
    path = Path(directory) / RECORDED_ANSWERS
    write_json_atomic(path, answers)
    return path


PIPE_DIR = Setting(
    "mps_pipe_dir",
    Path,
    "/tmp/nvidia-mps",
    env="CUDA_MPS_PIPE_DIRECTORY",
    flag="--mps-pipe-dir",
    metavar="DIR",
    help="the MPS control daemon's pipe directory",
)
FIXTURE = Setting(
    "mps_fixture",
    path_or_none,
    env=STAGETRACE_MPS_FIXTURE,
    flag="--mps-fixture",
    metavar="DIR",
    help="recorded nvidia-cuda-mps-control answers instead of the binary",
)


def mps_control(options: Options) -> MpsControl:
    return RecordedControl(options.mps_fixture) if options.mps_fixture else BinaryControl(options.mps_pipe_dir)


def _pids(output: str) -> list[int]:
    # isdigit() alone takes "²" and other Unicode digits, which int() refuses
    return [int(token) for token in output.split() if token.isascii() and token.isdigit()]


def _number(output: str) -> float:
    try:
        value = float(output.split()[0])
        if not math.isfinite(value):  # "nan", "inf": float() takes them, a percentage is neither
            raise ValueError(value)
        return value
    except (IndexError, ValueError):
        raise ControlUnanswered(
            f"unexpected answer {output.strip()!r} to get_default_active_thread_percentage"
        ) from None


@register
class MpsCollector(Collector):
    """CUDA MPS: daemon state from the control pipe, clients per GPU from NVML."""

    name = "mps"
    settings = (NVML_FIXTURE, PIPE_DIR, FIXTURE)

    def __init__(self, options: Options, *, control: MpsControl | None = None, nvml: NvmlSource | None = None):
        super().__init__(options)
        self.control = control if control is not None else mps_control(options)
        self.nvml = (
            nvml if nvml is not None else nvml_source(options, watch_xids=False)
        )  # the gpu collector counts them
        self._reads = CachedReads(self.nvml)
        self._nvml_open = False
        self._said: dict[str, str] = {}  # topic → what was last logged about it, so each reason is logged once

    def collect(self, out: Samples) -> None:
        self._collect_daemon(out)
        self._collect_clients(out)

    def _say_once(self, topic: str, message: str, level: int = logging.INFO) -> None:
        """Log ``message`` unless it is what was last said about ``topic``."""
        if self._said.get(topic) != message:
            self._said[topic] = message
            logger.log(level, "mps: %s", message)

    def _collect_daemon(self, out: Samples) -> None:
        try:
            servers = _pids(self.control.ask("get_server_list"))
            percentage = _number(self.control.ask("get_default_active_thread_percentage"))
            clients = {pid: _pids(self.control.ask(f"get_client_list {pid}")) for pid in servers}
        except ControlUnanswered as exc:
            self._say_once(
                "daemon", f"{exc}; mps_daemon_up 0", logging.INFO if isinstance(exc, NoDaemon) else logging.WARNING
            )
            out.add(DAEMON_UP, 0)
            return
        if self._said.pop("daemon", None) is not None:
            logger.info("mps: the control daemon answers again")
        out.add(DAEMON_UP, 1)
        out.add(SERVERS, len(servers))
        out.add(DEFAULT_ACTIVE_THREAD_PERCENTAGE, percentage)
        for pid, pids in clients.items():
            out.add(SERVER_CLIENTS, len(pids), pid=pid)

    def _collect_clients(self, out: Samples) -> None:
        try:
            if not self._nvml_open:
                self.nvml.open()
                self._nvml_open = True
            count = self.nvml.device_count()
        except (SourceUnavailable, *NVML_ERRORS) as exc:
            self._close_nvml()
            self._say_once(
                "nvml", f"no per-GPU MPS clients: {exc if isinstance(exc, SourceUnavailable) else error_name(exc)}"
            )
            return
        for index in range(count):
            try:
                uuid = self.nvml.read(index, "nvmlDeviceGetUUID")
                clients = self._reads.read(index, "nvmlDeviceGetMPSComputeRunningProcesses")
                samples = self._reads.read(index, "nvmlDeviceGetProcessUtilization") if clients else None
            except NVML_ERRORS as exc:  # the GPU is lost (the gpu collector says so): open NVML afresh next time
                self._say_once(
                    "nvml", f"gpu {index}: {error_name(exc)}; opening NVML afresh next scrape", logging.WARNING
                )
                self._close_nvml()
                break
            if clients is None:
                continue  # NVML cannot list MPS clients on this GPU
            out.add(CLIENTS, len(clients), gpu=index, uuid=uuid)
            for client in clients:
                if client["usedGpuMemory"] is not None:
                    out.add(CLIENT_MEMORY, client["usedGpuMemory"], gpu=index, uuid=uuid, pid=client["pid"])
            # Clients without samples get no series: NVML may account their work to the MPS server.
            sm_by_pid: dict[int, list[float]] = defaultdict(list)
            for sample in samples or ():
                sm_by_pid[sample["pid"]].append(sample["smUtil"])
            for pid in sorted({c["pid"] for c in clients} & sm_by_pid.keys()):
                out.add(CLIENT_SM_UTILIZATION, fmean(sm_by_pid[pid]) / 100, gpu=index, uuid=uuid, pid=pid)
        else:
            self._said.pop("nvml", None)  # a whole good pass: log the next failure again

    def _close_nvml(self) -> None:
        if self._nvml_open:
            self.nvml.close()
            self._nvml_open = False
            self._reads.forget()

    def close(self) -> None:
        self._close_nvml()
