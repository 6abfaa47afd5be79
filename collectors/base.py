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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from prometheus_client.core import Metric

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
        # Samples keys every series by its spec: hash the five fields once, not at each of a scrape's adds
        object.__setattr__(self, "_hash", hash((self.name, self.type, self.help, self.labels, self.unit)))

    def __hash__(self) -> int:
        return self._hash


class SourceUnavailable(Exception):
    """The collector's source is not on this machine (or not now); the message says which and why."""


def path_or_none(text: str) -> Path | None:
    """A path setting whose empty text means "not set"."""
    return Path(text) if text else None


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b,,c`` -> ``("a", "b", "c")``."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class Setting:
    """One setting a collector reads, as data: an :class:`Options` attribute, its flag and its environment fallback.

    ``parse`` turns the flag's or the variable's text into the value and raises ValueError, with a message a
    person can act on, for text it refuses. ``default`` is text (parsed the same way), a value, or a
    zero-argument callable called when the options are built. The first non-empty variable of ``env`` wins.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any = None
    env: str | tuple[str, ...] = ()
    flag: str | None = None
    help: str = ""
    metavar: str = "VALUE"
    shown_default: str = ""  # the default in words, for help, where it is not text (a callable, "" meaning something)

    def __post_init__(self):
        if not self.name.isidentifier() or self.name.startswith("_") or self.name == "from_args":
            raise ValueError(f"setting name {self.name!r} is not an attribute name Options can take")
        if self.flag is not None and not self.flag.startswith("--"):
            raise ValueError(f"setting {self.name}: flag {self.flag!r} must start with --")
        if isinstance(self.env, str):
            object.__setattr__(self, "env", (self.env,))

    def value(self, text: str | None = None, environ: Mapping[str, str] = os.environ):
        """The flag's text if given, else the first set variable, else the default; ValueError names the source."""
        source = self.flag
        if text is None:
            source, text = next(((name, environ[name]) for name in self.env if environ.get(name)), (None, None))
        if text is None:
            if callable(self.default):
                return self.default()
            return self.parse(self.default) if isinstance(self.default, str) else self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def help_text(self) -> str:
        """The flag's help: what it sets, its default when that is text, and its variables."""
        shown = self.shown_default or (self.default if isinstance(self.default, str) else "")
        notes = [f"default {shown}"] if shown else []
        notes += [f"env {' or '.join(self.env)}"] if self.env else []
        text = f"{self.help} ({'; '.join(notes)})" if notes else self.help
        return text.replace("%", "%%")  # argparse formats help with %


class Options:
    """The value of every setting of every registered collector: ``Options(sysfs=..., host=...)``.

    A keyword sets a value as it is given; an omitted setting takes its environment variable, else its
    default. The settings are those collectors declare (:attr:`Collector.settings`), so the built-in
    collectors' modules are imported first. An unknown keyword raises TypeError, as a dataclass would.
    """

    def __init__(self, **values):
        settings = all_settings()
        unknown = sorted(values.keys() - {s.name for s in settings})
        if unknown:
            raise TypeError(f"Options() got an unexpected keyword argument {', '.join(map(repr, unknown))}")
        for setting in settings:
            setattr(self, setting.name, values[setting.name] if setting.name in values else setting.value())

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] = os.environ) -> Options:
        """The options of a command line parsed with :func:`add_arguments`' flags: each flag, else its variable,
        else the default. Raises ValueError, naming the flag or the variable, for text a setting refuses."""
        flags = {s.name: getattr(args, s.name, None) for s in all_settings() if s.flag}
        return cls(**{s.name: s.value(flags.get(s.name), environ) for s in all_settings()})

    def __repr__(self) -> str:
        return f"Options({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces


# A setting several collectors read lives here; one only a collector reads lives in its module.
HOST = Setting(
    "host", str, socket.gethostname, env="STAGETRACE_HOST", flag="--host", metavar="NAME",
    help="the host label on every series", shown_default="this machine's hostname",
)  # fmt: skip
# node_exporter's --path.sysfs: the RDMA collector reads <sysfs>/class/infiniband, the ethtool one <sysfs>/class/net
SYSFS = Setting(
    "sysfs", Path, "/sys", env="STAGETRACE_SYSFS", flag="--sysfs", metavar="DIR",
    help="sysfs root the RDMA and ethtool collectors read",
)  # fmt: skip
SHARED_SETTINGS: tuple[Setting, ...] = (HOST, SYSFS)


def all_settings() -> tuple[Setting, ...]:
    """The shared settings, then each registered collector's, in registration order (built-in modules first)."""
    from stagetrace.collectors import available  # the package imports this module: import it late

    available()
    seen: dict[str, Setting] = {}
    for setting in (*SHARED_SETTINGS, *(s for cls in REGISTRY.values() for s in cls.settings)):
        seen.setdefault(setting.name, setting)
    return tuple(seen.values())


def add_arguments(group) -> None:
    """Add a flag for every setting that has one to an argparse parser or group; its value stays text until
    :meth:`Options.from_args` parses it, so a refused value is one line naming the flag, not argparse's usage."""
    for setting in all_settings():
        if setting.flag:
            group.add_argument(setting.flag, dest=setting.name, metavar=setting.metavar, default=None,
                               help=setting.help_text())  # fmt: skip


class Samples:
    """The samples of one collector in one scrape, grouped into metric families by spec."""

    def __init__(self):
        self._values: dict[MetricSpec, list[tuple[tuple[str, ...], float | Mapping[str, str]]]] = {}

    def add(self, spec: MetricSpec, value, **labels) -> None:
        """Add one series; ``labels`` must be exactly ``spec.labels``. Info metrics take a dict as value."""
        try:
            values = tuple([str(labels[k]) for k in spec.labels])  # a list first: faster than a generator
        except KeyError:
            values = None
        if values is None or len(labels) != len(spec.labels):
            raise ValueError(f"{spec.name}: labels {sorted(labels)} do not match {list(spec.labels)}")
        self.add_series(spec, values, value)

    def add_series(self, spec: MetricSpec, label_values: tuple[str, ...], value) -> None:
        """:meth:`add` with the label values as text in ``spec.labels`` order: for a collector adding many series
        under the same labels (a port's counters), without a keyword dict and a conversion per series."""
        if len(label_values) != len(spec.labels):
            raise ValueError(f"{spec.name}: {len(label_values)} label values for labels {list(spec.labels)}")
        series = self._values.get(spec)
        if series is None:
            series = self._values[spec] = []
        series.append((label_values, value))

    def series(self) -> Iterator[tuple[MetricSpec, tuple[str, ...], Any]]:
        """Every series added as (spec, label values in ``spec.labels`` order, value); an info metric's value is its
        dict of labels."""
        for spec, series in self._values.items():
            for values, value in series:
                yield spec, values, value

    def families(self, host: str) -> Iterator[Metric]:
        # here, not at the top: the metric specs are read by commands that build no families (`stagetrace trace`),
        # and client_python with its exposition server takes 20 ms to import
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

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
    """One hardware source. Subclasses set ``name``, declare the ``settings`` they read and implement ``collect``."""

    name: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True
    # what the collector reads from ``self.options``; the registry makes their flags and environment fallbacks
    settings: ClassVar[tuple[Setting, ...]] = ()

    def __init__(self, options: Options):
        self.options = options

    @classmethod
    def enabled_by_default(cls, options: Options) -> bool:
        """Whether a node built without named collectors runs this one: ``default_enabled``, unless the
        collector looks for its source first (the kubernetes collector runs where the kubelet's socket is)."""
        return cls.default_enabled

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
    declared = {s.name: s for s in SHARED_SETTINGS}
    declared.update((s.name, s) for c in REGISTRY.values() for s in c.settings)
    flags = {s.flag: s for s in declared.values() if s.flag}
    for setting in cls.settings:
        other = declared.get(setting.name) or flags.get(setting.flag)
        if other is not None and other is not setting:  # the same Setting object may be read by several collectors
            raise ValueError(f"collector {cls.name}: setting {setting.name} ({setting.flag}) is already declared")
        declared[setting.name] = setting
        if setting.flag:
            flags[setting.flag] = setting
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
        for samples in self.collect_samples():
            yield from samples.families(self.host)

    def collect_samples(self) -> list[Samples]:
        """One scrape as :class:`Samples`: each collector's that succeeded, then the collectors' status. The
        metric writer takes these as they are; :meth:`collect` makes client_python's families of them."""
        status = Samples()
        scraped: list[Samples] = []
        for collector in self.collectors:
            out = Samples()
            started = time.perf_counter()
            ok = self._run(collector, out)
            status.add(DURATION, time.perf_counter() - started, collector=collector.name)
            status.add(SUCCESS, 1.0 if ok else 0.0, collector=collector.name)
            if ok:
                scraped.append(out)
        scraped.append(status)
        return scraped

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
