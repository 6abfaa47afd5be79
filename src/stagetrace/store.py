"""One DSN selects the store: the embedded ClickHouse engine (chdb) or a ClickHouse server.

``chdb:///path``                       embedded engine under ``path`` (the default, see ``config``)
``chdb://memory``                      embedded engine in memory, gone when the process exits
``http(s)://user:pass@host:port/db``   a ClickHouse server or cluster over HTTP

The database is ``stagetrace`` unless the DSN names one (``/db`` for servers, ``?database=`` for chdb).
"""

from __future__ import annotations

import difflib
import errno
import fcntl
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from stagetrace import attributes, config, schema, through_agent

# StoreError and StoreLockedError re-exported: callers catch them from here
from stagetrace.environment_variables import STAGETRACE_STORE_PASSWORD_FILE, STAGETRACE_STORE_USER
from stagetrace.errors import StoreError, StoreLockedError, first_line

# The driver logs a failure before raising it; the store says it once, in its error. Where an application
# configures logging, the driver's records still reach its handlers.
logging.getLogger("clickhouse_connect").addHandler(logging.NullHandler())
logger = logging.getLogger(__name__)

SCHEMES = ("chdb", "http", "https")


@dataclass(frozen=True)
class Location:
    scheme: str
    database: str = config.DEFAULT_DATABASE
    path: str = ""  # chdb only; "" means in memory
    host: str = ""
    port: int = 0
    username: str = ""
    password: str = field(default="", repr=False)

    @property
    def embedded(self) -> bool:
        return self.scheme == "chdb"

    def redacted(self) -> str:
        """The DSN without its password, for messages and logs."""
        if self.embedded:
            return f"chdb://{self.path}" if self.path else "chdb://memory"
        user = f"{self.username}@" if self.username else ""
        return f"{self.scheme}://{user}{self.host}:{self.port}/{self.database}"


def parse_dsn(dsn: str | None = None) -> Location:
    """Parse a store DSN (``None``: ``$STAGETRACE_STORE``, else the default embedded store)."""
    dsn = dsn or config.store_dsn()
    parts = urlsplit(dsn)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        guess = difflib.get_close_matches(scheme, SCHEMES, n=1)
        hint = f"did you mean {guess[0]}://? " if guess else ""
        shown = f"scheme {scheme!r}" if scheme else "no scheme"
        raise StoreError(
            f"store DSN has {shown}: {hint}use chdb:///path for the embedded store "
            "or http(s)://user:pass@host:8123/db for a ClickHouse server"
        )
    query = parse_qs(parts.query)
    if scheme == "chdb":
        database = query.get("database", [config.DEFAULT_DATABASE])[0]
        if parts.netloc in ("memory", ":memory:"):
            path = ""
        elif parts.netloc:
            raise StoreError(
                f"store DSN chdb://{parts.netloc}{parts.path} is ambiguous: "
                "write chdb:///absolute/path (three slashes) or chdb://memory"
            )
        elif not parts.path:
            raise StoreError("store DSN chdb:// names no path: write chdb:///absolute/path or chdb://memory")
        else:
            path = os.path.abspath(os.path.expanduser(unquote(parts.path)))
        _check_database(database)
        return Location("chdb", database=database, path=path)
    if not parts.hostname:
        raise StoreError(f"store DSN {scheme}://... names no host: write {scheme}://user:pass@host:8123/db")
    try:
        port = parts.port or (8443 if scheme == "https" else 8123)
    except ValueError:
        raise StoreError(f"store DSN has an invalid port: write {scheme}://user:pass@host:8123/db") from None
    database = unquote(parts.path.strip("/")) or config.DEFAULT_DATABASE
    _check_database(database)
    return Location(
        scheme,
        database=database,
        host=parts.hostname,
        port=port,
        username=unquote(parts.username or "") or os.environ.get(STAGETRACE_STORE_USER, "default"),
        password=unquote(parts.password or "") or _password_from_environment(),
    )


def _password_from_environment() -> str:
    try:
        return config.store_password()
    except OSError as exc:
        raise StoreError(
            f"cannot read the store password file named by {STAGETRACE_STORE_PASSWORD_FILE}: {exc.strerror}"
        ) from None


def _check_database(name: str) -> None:
    try:
        schema.identifier(name, "database name")
    except schema.SchemaError as exc:
        raise StoreError(f"store DSN names an {exc}") from None


class Store:
    """An open store: a clickhouse-connect client and the database the tables live in.

    ``read_only`` when it is an embedded store read through the query endpoint of the agent that holds it, or
    one on a filesystem this process cannot write (read in place, see ``_open_read_only``).
    """

    def __init__(self, client, location: Location, read_only: bool = False):
        self.client = client
        self.location = location
        self.database = location.database
        self.read_only = read_only
        self._readable: dict[str, str] = {}
        self._layouts: dict[str, str] | None = None

    def layouts(self) -> dict[str, str]:
        """The attribute layout of each of the Collector's tables the store has (``attributes.layouts``): what every
        reader of those tables converts by (``schema.read_sql``). Asked of the store once."""
        if self._layouts is None:
            self._layouts = attributes.layouts(self.client, self.database)
        return self._layouts

    def readable(self, table: str) -> str:
        """What to read for one of the Collector's tables with attributes (``otel_traces``, ``otel_logs``) with Map
        attributes: the table itself where the Collector keeps Maps, else the view over it (``schema.READ_VIEWS``)
        that reads its JSON as Maps. A plain view costs a lookup's span read about 15 ms more than the table (measured
        on 120,000 spans, issue 55), which a Map store need not pay. Asked of the store once."""
        if not self._readable:
            layouts = self.layouts()
            self._readable = {
                t: next(v for v, of in schema.READ_VIEWS.items() if of == t) if layouts.get(t) == attributes.JSON else t
                for t in attributes.COLUMNS
            }
        return self._readable[table]

    def ensure_schema(self, cluster: str | None = None) -> bool:
        try:
            applied = schema.ensure_schema(self.client, self.database, cluster)
            if applied and self.location.embedded:  # once, as the schema is made or upgraded (a Collector's too)
                schema.make_durable(self.client, self.database)
            return applied
        except Exception as exc:  # the server's own message names the statement and the reason
            raise StoreError(f"cannot create the schema in {self.location.redacted()}: {first_line(exc)}") from exc

    def close(self) -> None:
        self.client.close()

    def another(self) -> Store:
        """A store for another thread: a client of its own for a server (an HTTP client runs one query at a time
        in its session); the same one for an embedded store, whose engine serializes what its client sends."""
        if self.location.embedded or self.read_only:
            return self
        return Store(_open_server(self.location), self.location)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The embedded engine's server settings for a node agent, which holds one node's store for days: its caches sized
# for that rather than for a server (5 GiB each by default), and the memory worker, which reconciles the engine's
# memory accounting with the process's, waking every second instead of every 100 ms (0.2% of a core, measured).
AGENT_ENGINE = {
    "mark_cache_size": str(64 << 20),
    "index_mark_cache_size": str(16 << 20),
    "primary_index_cache_size": str(64 << 20),
    "query_condition_cache_size": str(16 << 20),
    "memory_worker_period_ms": "1000",
}


def open_store(
    dsn: str | Location | None = None,
    *,
    create_schema: bool = True,
    agent_fallback: bool = True,
    must_exist: bool = False,
    engine: dict[str, str] | None = None,
) -> Store:
    """Open the store ``dsn`` names, creating the database and tables unless told not to.

    An embedded store held by ``stagetrace agent`` is opened read-only through the agent's query endpoint
    (``stagetrace.through_agent``), unless ``agent_fallback`` is False: then StoreLockedError, as for any other holder.
    ``must_exist`` (the commands that read): a store that is not there is a StoreError, never created empty
    (a typo in a path would otherwise show an empty store). ``engine``: server settings for an embedded engine
    this call starts (``AGENT_ENGINE``); chdb starts one engine per process, so they apply to its first store.
    """
    location = dsn if isinstance(dsn, Location) else parse_dsn(dsn)
    if must_exist and location.embedded and location.path and not (Path(location.path) / "metadata").is_dir():
        default = Path(location.path) == Path(config.default_store_path())
        where = "the default store" if default else f"a typo? the default is {config.default_store_path()}"
        raise StoreError(f"no store at {location.path} ({where}; `stagetrace demo` or `stagetrace agent` creates one)")
    try:
        if must_exist and location.embedded and location.path and not os.access(location.path, os.W_OK | os.X_OK):
            store = Store(_open_read_only(location), location, read_only=True)
        else:
            client = _open_embedded(location, engine) if location.embedded else _open_server(location)
            store = Store(client, location)
    except StoreLockedError as locked:
        if not agent_fallback:
            raise
        # raises ``locked`` when no agent serves this store
        store = Store(through_agent.client(location, locked), location, read_only=True)
    if (
        must_exist
        and not location.embedded
        and not store.client.command("EXISTS DATABASE {db:Identifier}", parameters={"db": location.database})
    ):
        store.close()
        raise StoreError(
            f"no database {location.database} at {location.redacted()} (a typo? `stagetrace schema "
            f"--store {location.redacted()}` creates it)"
        )
    if create_schema:
        try:
            store.ensure_schema()
        except StoreError:
            store.close()
            raise
    return store


def _open_embedded(location: Location, engine: dict[str, str] | None = None):
    if location.path:
        _check_writable(Path(location.path))
        _check_not_locked(Path(location.path))
    import clickhouse_connect  # after the checks: a store an agent holds is read without the driver (0.2 s)

    try:
        return clickhouse_connect.get_client(interface="chdb", path=location.path or None, chdb_options=engine or None)
    except Exception as exc:
        message = first_line(exc)
        if "already initialized with path" in message:
            raise StoreError(
                f"this process already has another embedded store open; chdb allows one per process: "
                f"close it before opening {location.redacted()}"
            ) from None
        raise StoreError(f"cannot open the embedded store {location.redacted()}: {message}") from None


def _open_read_only(location: Location):
    """An embedded store the process cannot write (a read-only mount, a snapshot, another user's store) for
    reading: chdb must write where its engine runs, so it runs in a scratch directory and attaches the store's
    tables where they lie, through a read-only disk (without deduplication logs, which it would write)."""
    import atexit
    import shutil
    import tempfile

    import clickhouse_connect

    root = Path(location.path).resolve()
    tables = sorted((root / "metadata" / location.database).glob("*.sql"))
    scratch = tempfile.mkdtemp(prefix="stagetrace-read-only-")
    atexit.register(shutil.rmtree, scratch, True)
    try:
        client = clickhouse_connect.get_client(
            interface="chdb", path=scratch, chdb_options={"custom_local_disks_base_directory": str(root.parent)}
        )
        client.command("CREATE DATABASE IF NOT EXISTS {db:Identifier}", parameters={"db": location.database})
        disk = f"disk = disk(type = 'local', path = '{root}/', readonly = 1)"
        for table in tables:
            ddl = table.read_text()
            if not ddl.startswith("ATTACH TABLE _ ") or "MergeTree" not in ddl:
                continue  # views: nothing to read through them
            ddl = ddl.replace("ATTACH TABLE _", f"ATTACH TABLE `{location.database}`.`{table.stem}`", 1)
            ddl = re.sub(r"non_replicated_deduplication_window = \d+", "non_replicated_deduplication_window = 0", ddl)
            ddl = f"{ddl.rstrip()}, {disk}" if "\nSETTINGS " in ddl else f"{ddl.rstrip()} SETTINGS {disk}"
            client.command(ddl)
    except Exception as exc:
        raise StoreError(f"cannot read the read-only store {location.redacted()}: {first_line(exc)}") from None
    return client


_warned_modes: set[Path] = set()


def _check_writable(path: Path) -> None:
    try:
        if not path.exists():  # the store is the owner's alone: spans may carry what operators consider private
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
    except FileExistsError:  # made meanwhile by another process
        pass
    except OSError as exc:
        raise StoreError(
            f"store path {path} is not writable ({os.strerror(exc.errno or errno.EACCES)}): "
            "choose another with --store chdb:///path or STAGETRACE_STORE"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreError(
            f"store path {path} is not writable (permission denied): "
            "choose another with --store chdb:///path or STAGETRACE_STORE"
        )
    mode = path.stat().st_mode & 0o777
    if mode & 0o077 and path not in _warned_modes:
        _warned_modes.add(path)
        logger.warning("store %s can be read by other users (mode %o): chmod 700 %s", path, mode, path)


def _check_not_locked(path: Path) -> None:
    """ClickHouse holds an exclusive flock on ``status`` (which records its PID) while the engine is open."""
    status = path / "status"
    try:
        fd = os.open(status, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_from_status(status)
            if pid == os.getpid():
                return  # this process's own engine: chdb shares it between clients
            raise StoreLockedError(
                f"store {path} is in use by {_describe_process(pid)}; stop that process, "
                "or use a different store with --store chdb:///other/path",
                pid,
            ) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _pid_from_status(status: Path) -> int | None:
    try:
        for line in status.read_text(errors="replace").splitlines():
            if line.startswith("PID:"):
                return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def _describe_process(pid: int | None) -> str:
    if pid is None:
        return "another process"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        command = " ".join(a.decode(errors="replace") for a in argv if a)[:120]
    except OSError:
        command = ""
    return f"process {pid} ({command})" if command else f"process {pid}"


def without_dataframe_checks() -> None:
    """For a process of stagetrace's own (the agent), which inserts lists: tell clickhouse-connect that pandas and
    NumPy are absent where the process has not loaded them. The driver tells a DataFrame or an array from other
    insert data by importing pandas, which imports NumPy and pyarrow: 70 MB an agent with a server store would load
    for nothing, and pandas alone beside the embedded engine (which loads the other two). Not for ``open_store``
    in general: it also runs in applications (the span exporter), whose own DataFrame calls must keep working."""
    from clickhouse_connect.driver import options

    if "pandas" not in sys.modules and "pd" not in vars(options):
        options.pd = options.pd_time_test = None
    if "numpy" not in sys.modules and "np" not in vars(options):
        options.np = None


def _open_server(location: Location):
    import clickhouse_connect

    try:
        client = clickhouse_connect.get_client(
            host=location.host,
            port=location.port,
            username=location.username,
            password=location.password,
            secure=location.scheme == "https",
            connect_timeout=5,
        )
    except Exception as exc:
        raise StoreError(f"cannot reach ClickHouse at {location.redacted()}: {_unreachable(exc, location)}") from None
    return client


def _unreachable(exc: BaseException, location: Location) -> str:
    """Why a server could not be reached, in a few words: the OS's reason when the driver's message quotes
    one (under a retry dump of urllib3), else its first line; never the password."""
    text = first_line(exc)
    reason = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text) or re.search(r"(timed out|Name or service not known)", text)
    if reason:
        text = reason[1].strip().rstrip(".")
        text = (
            f"{text[0].lower()}{text[1:]} (is the server running, and is {location.host}:{location.port} its address?)"
        )
    return text.replace(location.password, "***") if location.password else text
