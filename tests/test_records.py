"""The kinds of write-ahead record: each registered by the module that writes it, found by any process that replays."""

import subprocess
import sys

import pytest

from stagetrace.exporters import records


def test_a_process_that_never_imported_the_receiver_decodes_its_records():
    """The span API's exporter replays what a killed agent wrote ahead: the kind's module is imported when met."""
    probe = (
        "import sys; from stagetrace.exporters import records\n"
        "assert 'stagetrace.exporters.otlp' not in sys.modules and not records.KINDS\n"
        "decode = records.decoder('otlp_traces')\n"
        "print(decode.__module__, sorted(records.KINDS))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["stagetrace.exporters.otlp", "['otlp_logs',", "'otlp_metrics',", "'otlp_traces']"]


def test_the_receivers_kinds_are_what_the_replay_finds_by_name():
    from stagetrace.exporters.otlp import LOGS, METRICS, TRACES

    for kind in (TRACES, METRICS, LOGS):
        assert records.decoder(kind.name) is kind.decode


def test_an_unknown_kind_is_refused_and_a_taken_name_is_not_registered_twice():
    with pytest.raises(records.UnknownRecordKind, match="no module registers records of kind 'otlp_profiles'"):
        records.decoder("otlp_profiles")
    from stagetrace.exporters.otlp import TRACES

    assert records.register(TRACES.name, TRACES.decode) == TRACES  # the same decoder again: nothing changes
    with pytest.raises(ValueError, match="record kind otlp_traces is registered already"):
        records.register(TRACES.name, lambda payload: {})
    assert records.decoder(TRACES.name) is TRACES.decode
