"""The collector contract, metric descriptions as data, and the registry of collectors by name.

A collector reads one hardware source at scrape time and adds samples to a :class:`Samples`
built from :class:`MetricSpec` descriptions (name, type, help, unit, labels), the way
dcgm-exporter describes its counters as data. :class:`Node` runs the enabled collectors,
times them, adds ``host`` to every series and reports ``stagetrace_collector_success`` and
``stagetrace_collector_duration_seconds``; it is itself a client_python collector, so the
Prometheus exporter registers it as is and the ClickHouse writer reads the same families.

A source that is absent (no GPU, no ``/sys/class/infiniband``) raises :class:`SourceUnavailable`;
the node logs that once, reports success 0, and logs again only after the source came back.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

logger = logging.getLogger("stagetrace.collectors")

COUNTER, GAUGE, INFO = "counter", "gauge", "info"


@dataclass(frozen=True)
class MetricSpec:
    """One metric, described as data. Counter names end in ``_total``; base units are in the name."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""  # e.g. "bytes", "watts", "seconds", "celsius": kept as the sample's MetricUnit

    def __post_init__(self):
        if self.type not in (COUNTER, GAUGE, INFO):
            raise ValueError(f"{self.name}: type must be counter, gauge or info")
        if (self.type == COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        # client_python appends the unit to a name that does not end in it; the name must carry it already
        if self.unit and not self.name.removesuffix("_total").endswith(f"_{self.unit}"):
            raise ValueError(f"{self.name}: the name must end in its unit, _{self.unit}")


class SourceUnavailable(Exception):
    """The collector's source is not on this machine (or not now); the message says which and why."""


@dataclass
class Options:
    """Settings every collector may read; each is an argument with an environment fallback."""

    host: str = field(default_factory=lambda: os.environ.get("STAGETRACE_HOST") or socket.gethostname())
    # node_exporter's --path.sysfs: the RDMA collector reads <sysfs>/class/infiniband
    sysfs: Path = field(default_factory=lambda: Path(os.environ.get("STAGETRACE_SYSFS", "/sys")))
    # a directory of recorded NVML snapshots instead of the real library (tests, the demo)
    nvml_fixture: Path | None = field(default_factory=lambda: _path_env("STAGETRACE_NVML_FIXTURE"))
    mps_pipe_dir: Path = field(default_factory=lambda: Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")))
    # recorded `nvidia-cuda-mps-control` answers instead of running the binary (tests, the demo)
    mps_fixture: Path | None = field(default_factory=lambda: _path_env("STAGETRACE_MPS_FIXTURE"))
    # netdevs the ethtool collector reads (empty: those behind RDMA ports, else every non-loopback one)
    netdevs: tuple[str, ...] = field(default_factory=lambda: tuple(filter(None, os.environ.get("STAGETRACE_NETDEVS", "").split(","))))
    ethtool_include: str = field(default_factory=lambda: os.environ.get("STAGETRACE_ETHTOOL_INCLUDE", ""))
    ethtool_fixture: Path | None = field(default_factory=lambda: _path_env("STAGETRACE_ETHTOOL_FIXTURE"))
    # the directory NCCL Inspector dumps into (NCCL_INSPECTOR_PROM_DUMP=1 with NCCL_INSPECTOR_DUMP_DIR)
    nccl_dir: Path | None = field(default_factory=lambda: _path_env("STAGETRACE_NCCL_DIR") or _path_env("NCCL_INSPECTOR_DUMP_DIR"))


def _path_env(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


class Samples:
    """The samples of one collector in one scrape, grouped into metric families by spec."""

    def __init__(self):
        self._values: dict[MetricSpec, list[tuple[tuple[str, ...], float | Mapping[str, str]]]] = {}

    def add(self, spec: MetricSpec, value, **labels) -> None:
        """Add one series; ``labels`` must be exactly ``spec.labels``. Info metrics take a dict as value."""
        if labels.keys() != set(spec.labels):
            raise ValueError(f"{spec.name}: labels {sorted(labels)} do not match {list(spec.labels)}")
        self._values.setdefault(spec, []).append((tuple(str(labels[k]) for k in spec.labels), value))

    def families(self, host: str) -> Iterator[Metric]:
        for spec, series in self._values.items():
            names = ["host", *spec.labels]
            if spec.type == INFO:
                family = InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=names)
            elif spec.type == COUNTER:
                family = CounterMetricFamily(spec.name, spec.help, labels=names, unit=spec.unit)
            else:
                family = GaugeMetricFamily(spec.name, spec.help, labels=names, unit=spec.unit)
            for values, value in series:
                family.add_metric([host, *values], value)
            yield family


class Collector:
    """One hardware source. Subclasses set ``name`` and implement ``collect``."""

    name: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True

    def __init__(self, options: Options):
        self.options = options

    def collect(self, out: Samples) -> None:
        """Read the source now and add its samples; raise SourceUnavailable when it is absent."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the collector holds (threads, library handles)."""


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    """Class decorator: make a collector available under ``cls.name`` (node_exporter's registerCollector)."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"collector name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


SUCCESS = MetricSpec("stagetrace_collector_success", GAUGE, "Whether the collector's last scrape succeeded.", ("collector",))
DURATION = MetricSpec(
    "stagetrace_collector_duration_seconds", GAUGE, "How long the collector's last scrape took.", ("collector",), "seconds"
)


class Node:
    """The enabled collectors of one host, scraped together (a client_python custom collector)."""

    def __init__(self, collectors: list[Collector], host: str):
        self.collectors = collectors
        self.host = host
        self._unavailable: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        status = Samples()
        families: list[Metric] = []
        for collector in self.collectors:
            out = Samples()
            started = time.perf_counter()
            ok = self._run(collector, out)
            status.add(DURATION, time.perf_counter() - started, collector=collector.name)
            status.add(SUCCESS, 1.0 if ok else 0.0, collector=collector.name)
            if ok:
                families.extend(out.families(self.host))
        yield from families
        yield from status.families(self.host)

    def _run(self, collector: Collector, out: Samples) -> bool:
        try:
            collector.collect(out)
        except SourceUnavailable as exc:
            if collector.name not in self._unavailable:
                logger.warning("collector %s: %s", collector.name, exc)
                self._unavailable.add(collector.name)
            return False
        except Exception as exc:  # one broken collector must not take the scrape down
            logger.error("collector %s failed: %s: %s", collector.name, type(exc).__name__, exc)
            return False
        if collector.name in self._unavailable:
            logger.info("collector %s: source is back", collector.name)
            self._unavailable.discard(collector.name)
        return True

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()
