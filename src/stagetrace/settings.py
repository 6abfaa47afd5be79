"""Settings as data, and the one grammar each for sizes and durations that every flag and variable is read with.

A :class:`Setting` is one value a command reads: its flag, its environment variables, its default and the parser
that turns their text into the value (with a message a person can act on for text it refuses). :class:`Options`
holds the values of a set of settings as attributes and :func:`add_arguments` makes their flags; the collectors'
options (``collectors.base.Options``) are the settings the registered collectors declare, and the agent's
(``agent_config``) and the store's are read the same way.

Sizes are written ``512MiB``, ``2GiB``, ``1.5G``, ``1000000`` (bytes): binary units as ``KiB``/``MiB``/... or their
one-letter short forms ``K``/``M``/``G``/``T``, decimal ones as ``KB``/``MB``/..., any case. Durations are written
``500ms``, ``5s``, ``1.5m``, ``1h``, ``10d``, ``2w``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(|b|kib|mib|gib|tib|kb|mb|gb|tb|k|m|g|t)\s*", re.IGNORECASE)
_BYTES = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h|d|w)\s*")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_size(text: str, zero: bool = False) -> int:
    """``1GiB``, ``512MiB``, ``1.5G``, ``1000000`` -> bytes; ``zero``: ``0`` is a size too. ValueError says how to
    write it."""
    match = _SIZE.fullmatch(text)
    size = int(float(match[1]) * _BYTES[match[2].lower()]) if match else -1
    if size < 0 or (size == 0 and not zero):
        raise ValueError(
            f"{text!r} is not a {'' if zero else 'positive '}size: write e.g. 1GiB, 512MiB or 1000000"
            + (" (0 for none)" if zero else "")
        )
    return size


def parse_duration(text: str) -> float:
    """``500ms``, ``5s``, ``1.5m``, ``1h``, ``10d``, ``2w`` -> seconds; ValueError says how to write it."""
    match = _DURATION.fullmatch(text)
    seconds = float(match[1]) * _SECONDS[match[2]] if match else 0.0
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration: write e.g. 500ms, 5s, 1m, 1h, 10d or 2w")
    return seconds


@dataclass(frozen=True)
class Setting:
    """One setting as data: an attribute name, its flag and its environment fallback.

    ``parse`` turns the flag's or the variable's text into the value and raises ValueError, with a message a
    person can act on, for text it refuses. ``default`` is text (parsed the same way), a value, or a
    zero-argument callable called when the value is read. The first non-empty variable of ``env`` wins.
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
    """The value of each of a set of settings, as attributes: ``Options(sysfs=..., host=...)``.

    A keyword sets a value as it is given; an omitted setting takes its environment variable, else its default.
    A subclass names its settings (:meth:`_settings`, called when an instance is made, so a registry can grow). An
    unknown keyword raises TypeError, as a dataclass would.
    """

    @classmethod
    def _settings(cls) -> tuple[Setting, ...]:  # private: no setting's name can take it (Setting refuses "_")
        raise NotImplementedError(f"{cls.__name__} names no settings")

    def __init__(self, **values):
        settings = self._settings()
        unknown = sorted(values.keys() - {s.name for s in settings})
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got an unexpected keyword argument {', '.join(map(repr, unknown))}"
            )
        for setting in settings:
            setattr(self, setting.name, values[setting.name] if setting.name in values else setting.value())

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] = os.environ) -> Options:
        """The options of a command line parsed with :func:`add_arguments`' flags: each flag, else its variable,
        else the default. Raises ValueError, naming the flag or the variable, for text a setting refuses."""
        settings = cls._settings()
        flags = {s.name: getattr(args, s.name, None) for s in settings if s.flag}
        return cls(**{s.name: s.value(flags.get(s.name), environ) for s in settings})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces


def add_arguments(group, settings: Iterable[Setting]) -> None:
    """Add a flag for every setting that has one to an argparse parser or group; its value stays text until
    :meth:`Options.from_args` parses it, so a refused value is one line naming the flag, not argparse's usage."""
    for setting in settings:
        if setting.flag:
            group.add_argument(
                setting.flag, dest=setting.name, metavar=setting.metavar, default=None, help=setting.help_text()
            )


__all__ = ["Options", "Setting", "add_arguments", "parse_duration", "parse_size"]
