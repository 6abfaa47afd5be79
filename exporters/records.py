"""The kinds of write-ahead record: a registry in which each kind's module registers the function that turns one
record into rows.

A record (``exporters.spool``) is a request as it arrived, kept with its kind's name. The module that writes a kind
registers it (``TRACES = register("otlp_traces", trace_tables)`` in ``exporters.otlp``) and hands the
:class:`RecordKind` to the durable writer, which decodes with it. The durable writer's replay and the restorer read
records back through :func:`decoder`. Any writer replays any record, so what a killed agent wrote ahead is stored by
whichever process writes next: a process that has not imported the kind's module (the span API's exporter) has the
modules that register kinds (:data:`MODULES`) imported the first time it meets a kind, as the collectors' registry
imports the built-in collectors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

Decode = Callable[[bytes], dict[str, tuple]]  # a record's bytes -> {table: (columns, rows)}


@dataclass(frozen=True)
class RecordKind:
    """One kind of record: ``name`` as the spool stores it, ``decode`` its bytes into rows by table."""

    name: str
    decode: Decode


KINDS: dict[str, RecordKind] = {}
# the modules of this package that register record kinds, imported when a record of a kind not yet registered is met
MODULES = ("otlp",)


class UnknownRecordKind(KeyError):
    """A record of a kind no module registers (written by another version): it can never be stored."""


def register(name: str, decode: Decode) -> RecordKind:
    """Register a kind of record and its decoder; registering the same decoder again (a module reloaded) is a no-op,
    another one under a taken name a ValueError."""
    known = KINDS.get(name)
    if known is not None and known.decode is not decode and known.decode.__qualname__ != decode.__qualname__:
        raise ValueError(f"record kind {name} is registered already, by {known.decode.__module__}")
    kind = KINDS[name] = RecordKind(name, decode)
    return kind


def decoder(name: str) -> Decode:
    """The function that turns a record of kind ``name`` into rows; UnknownRecordKind for a kind none registers."""
    if name not in KINDS:
        for module in MODULES:
            importlib.import_module(f"stagetrace.exporters.{module}")  # a module registers its kinds
    try:
        return KINDS[name].decode
    except KeyError:
        raise UnknownRecordKind(f"no module registers records of kind {name!r}") from None


__all__ = ["KINDS", "MODULES", "Decode", "RecordKind", "UnknownRecordKind", "decoder", "register"]
