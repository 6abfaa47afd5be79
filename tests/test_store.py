import os
import subprocess
import sys
import time

import pytest

from stagetrace import config
from stagetrace.cli import main
from stagetrace.store import StoreError, StoreLockedError, open_store, parse_dsn


def test_default_store_is_embedded_under_xdg_data_home(monkeypatch, tmp_path):
    monkeypatch.delenv(config.ENV_STORE, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    location = parse_dsn(None)
    assert location.embedded and location.path == str(tmp_path / "stagetrace" / "store")
    assert location.database == "stagetrace"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert parse_dsn(None).path == os.path.expanduser("~/.local/share/stagetrace/store")


def test_environment_selects_the_store(monkeypatch):
    monkeypatch.setenv(config.ENV_STORE, "http://reader@ch.internal:8123/traces")
    location = parse_dsn(None)
    assert (location.scheme, location.host, location.port, location.database) == ("http", "ch.internal", 8123, "traces")


def test_server_dsn_keeps_the_password_out_of_messages(monkeypatch):
    monkeypatch.delenv(config.ENV_STORE_PASSWORD, raising=False)
    location = parse_dsn("https://ops:s3cret@ch.example:8443/st")
    assert location.password == "s3cret"
    assert "s3cret" not in location.redacted() and "s3cret" not in repr(location)


def test_password_comes_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    monkeypatch.setenv(config.ENV_STORE_PASSWORD_FILE, str(secret))
    assert parse_dsn("http://ops@ch:8123/st").password == "from-file"
    monkeypatch.setenv(config.ENV_STORE_PASSWORD_FILE, str(tmp_path / "missing"))
    with pytest.raises(StoreError, match="cannot read the store password file"):
        parse_dsn("http://ops@ch:8123/st")


@pytest.mark.parametrize(
    "dsn, message",
    [
        ("chbd:///tmp/x", "did you mean chdb://"),
        ("htpp://host:8123/db", "did you mean http://"),
        ("/var/lib/stagetrace", "no scheme"),
        ("chdb://tmp/x", "three slashes"),
        ("http:///db", "names no host"),
        ("http://host:99999/db", "invalid port"),
        ("http://host:8123/bad;name", "invalid database name"),
    ],
)
def test_bad_dsns_get_one_actionable_line(dsn, message):
    with pytest.raises(StoreError, match=message) as caught:
        parse_dsn(dsn)
    assert "\n" not in str(caught.value)


def test_unwritable_store_path(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["schema", "--store", f"chdb://{blocker}/store"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stagetrace: store path") and "not writable" in err and err.count("\n") == 1


def test_unreachable_server_is_one_line_without_the_password(capsys):
    assert main(["trace", "r1", "--store", "http://ops:hunter2@127.0.0.1:9/st"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach ClickHouse at http://ops@127.0.0.1:9/st" in err
    assert "hunter2" not in err and err.count("\n") == 1


def test_a_locked_store_names_the_process_holding_it(tmp_path):
    path = tmp_path / "store"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from stagetrace.store import open_store; s = open_store(sys.argv[1]); "
            "print('open', flush=True); time.sleep(60)",
            f"chdb://{path}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreLockedError, match=f"in use by process {holder.pid} "):
            open_store(f"chdb://{path}")
        cli = subprocess.run(
            [sys.executable, "-m", "stagetrace", "trace", "r1", "--store", f"chdb://{path}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 2
        assert "Traceback" not in cli.stderr and cli.stderr.count("\n") == 1
        assert f"is in use by process {holder.pid}" in cli.stderr and "stop that process" in cli.stderr
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    with open_store(f"chdb://{path}") as store:  # usable again once the holder is gone
        assert store.client.command("SELECT 1") == 1


def test_store_in_memory(tmp_path):
    with open_store("chdb://memory") as store:
        assert store.location.path == "" and store.client.command("SELECT count() FROM stagetrace.otel_traces") == 0
