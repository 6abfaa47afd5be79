"""``--web-config-file``: TLS and basic auth for every listener, in Prometheus exporter-toolkit's web configuration
format, the one node_exporter and dcgm-exporter read::

    tls_server_config:
      cert_file: /etc/stagetrace/tls/tls.crt      # relative paths are read from the file's folder
      key_file: /etc/stagetrace/tls/tls.key
      client_auth_type: RequireAndVerifyClientCert  # or NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: /etc/stagetrace/tls/ca.crt
      min_version: TLS12                           # TLS10..TLS13; max_version too
    basic_auth_users:
      prometheus: $2y$10$...                       # bcrypt hashes (htpasswd -nBC 10)

The certificate, key and CA files are read again when they change (cert-manager replaces them in place): each new
connection gets the newest pair that loads, without a restart, and connections already open keep theirs. A pair
caught half-written is not taken until it loads, and the old one serves meanwhile.

What Python's TLS cannot do is refused with one line: ``RequestClientCert`` and ``RequireAnyClientCert`` ask for a
certificate without verifying it, and ``cipher_suites`` and ``curve_preferences`` name Go's settings.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from stagetrace.environment_variables import (
    STAGETRACE_CA_FILE,
    STAGETRACE_CLIENT_CERT_FILE,
    STAGETRACE_CLIENT_KEY_FILE,
    STAGETRACE_WEB_CONFIG_FILE,
)
from stagetrace.errors import first_line

logger = logging.getLogger(__name__)

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
RELOAD_CHECK_S = 1.0  # how often a new connection looks at the files' modification times


class WebConfigError(ValueError):
    """The web configuration file cannot be used; the message names the file and what to change."""


@dataclass(frozen=True)
class WebConfig:
    """A loaded web configuration: ``tls`` when its listeners speak TLS, ``users`` the basic-auth bcrypt hashes."""

    path: Path
    tls: ServerTLS | None = None
    users: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike) -> WebConfig:
        path = Path(path)
        try:
            document = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise WebConfigError(f"cannot read the web configuration {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise WebConfigError(f"the web configuration {path} is not YAML: {first_line(exc)}") from None
        if not isinstance(document, dict):
            raise WebConfigError(
                f"the web configuration {path} must be a mapping (tls_server_config, basic_auth_users)"
            )
        unknown = set(document) - {"tls_server_config", "basic_auth_users", "http_server_config"}
        if unknown:
            raise WebConfigError(
                f"the web configuration {path} has {', '.join(sorted(unknown))}, which stagetrace does "
                "not know: use tls_server_config and basic_auth_users"
            )
        users = document.get("basic_auth_users") or {}
        if not isinstance(users, dict) or not all(isinstance(h, str) and h.startswith("$2") for h in users.values()):
            raise WebConfigError(f"basic_auth_users in {path} must map each user to a bcrypt hash ($2y$...)")
        tls = document.get("tls_server_config")
        return cls(
            path,
            ServerTLS(_tls_settings(path, tls)) if tls else None,
            {str(user): hashed.encode() for user, hashed in users.items()},
        )

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def user_admitted(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Basic`` header names a user of ``basic_auth_users`` with the right password."""
        import base64

        import bcrypt

        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        return hashed is not None and bcrypt.checkpw(password.encode(), hashed)


def load(path: str | None) -> WebConfig | None:
    """The web configuration named by ``path`` (else ``$STAGETRACE_WEB_CONFIG_FILE``), or None for plain HTTP."""
    path = path or os.environ.get(STAGETRACE_WEB_CONFIG_FILE) or None
    return WebConfig.load(path) if path else None


@dataclass(frozen=True)
class _Settings:
    cert_file: Path
    key_file: Path
    client_auth: str
    client_ca_file: Path | None
    min_version: str
    max_version: str | None


def _tls_settings(path: Path, tls) -> _Settings:
    where = f"tls_server_config in {path}"
    if not isinstance(tls, dict):
        raise WebConfigError(f"{where} must be a mapping")
    unknown = set(tls) - _TLS_KEYS
    if unknown:
        raise WebConfigError(
            f"{where}: {', '.join(sorted(unknown))} cannot be set here (Go's TLS settings); "
            f"stagetrace reads {', '.join(sorted(_TLS_KEYS))}"
        )
    if not tls.get("cert_file") or not tls.get("key_file"):
        raise WebConfigError(f"{where} needs cert_file and key_file")
    client_auth = tls.get("client_auth_type") or "NoClientCert"
    if client_auth not in CLIENT_AUTH:
        raise WebConfigError(
            f"{where}: client_auth_type {client_auth} is not supported (Python's TLS verifies every "
            f"certificate it asks for): use {', '.join(CLIENT_AUTH)}"
        )
    if client_auth != "NoClientCert" and not tls.get("client_ca_file"):
        raise WebConfigError(f"{where}: client_auth_type {client_auth} needs client_ca_file to verify clients against")
    for key in ("min_version", "max_version"):
        if tls.get(key) and tls[key] not in VERSIONS:
            raise WebConfigError(f"{where}: {key} {tls[key]} is not one of {', '.join(VERSIONS)}")

    def file(key: str) -> Path | None:
        return (path.parent / tls[key]) if tls.get(key) else None

    return _Settings(
        file("cert_file"),
        file("key_file"),
        client_auth,
        file("client_ca_file"),
        tls.get("min_version") or "TLS12",
        tls.get("max_version"),
    )


class ServerTLS:
    """The listeners' TLS: a server context built from the files, built again when they change."""

    def __init__(self, settings: _Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._stamp = self._stamps()
        self._context = self._build()  # a file that cannot be read or loaded fails the start, in one line
        self._checked = time.monotonic()
        self._failing = False

    @property
    def client_auth(self) -> str:
        return self.settings.client_auth

    def _files(self) -> list[Path]:
        s = self.settings
        return [p for p in (s.cert_file, s.key_file, s.client_ca_file) if p is not None]

    def _stamps(self) -> tuple:
        out = []
        for path in self._files():
            try:
                status = path.stat()
                out.append((status.st_mtime_ns, status.st_size, status.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def _build(self) -> ssl.SSLContext:
        s = self.settings
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = VERSIONS[s.min_version]
        if s.max_version:
            context.maximum_version = VERSIONS[s.max_version]
        try:
            context.load_cert_chain(s.cert_file, s.key_file)
            if s.client_ca_file:
                context.load_verify_locations(cafile=s.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"cannot load the TLS certificate {s.cert_file} with key {s.key_file}"
                f"{f' and CA {s.client_ca_file}' if s.client_ca_file else ''}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        context.verify_mode = CLIENT_AUTH[s.client_auth]
        return context

    def context(self) -> ssl.SSLContext:
        """The newest context that loads: the files are looked at once a second at most."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return self._context
        with self._lock:
            self._checked = now
            stamp = self._stamps()
            if stamp != self._stamp:
                try:
                    self._context, self._stamp = self._build(), stamp
                    logger.info("TLS certificate %s loaded again", self.settings.cert_file)
                    self._failing = False
                except WebConfigError as exc:  # caught mid-replacement: the old pair serves until the new one loads
                    if not self._failing:
                        logger.warning("%s; serving with the previous certificate", exc)
                        self._failing = True
            return self._context

    def wrap(self, sock):
        """An accepted connection, to be handshaken in its own thread (``do_handshake``), never in the accept loop."""
        return self.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)

    def grpc_credentials(self):
        """gRPC server credentials that take the files again when they change, as the HTTP listeners do."""
        import grpc

        s = self.settings

        def configuration():
            root = s.client_ca_file.read_bytes() if s.client_ca_file else None
            return grpc.ssl_server_certificate_configuration(
                [(s.key_file.read_bytes(), s.cert_file.read_bytes())], root_certificates=root
            )

        served = {"stamp": self._stamps()}

        def fetch():  # called for each new connection: None keeps the current pair
            stamp = self._stamps()
            if stamp == served["stamp"]:
                return None
            try:  # a pair caught half-written does not load: the current one serves until it does
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(s.cert_file, s.key_file)
                fresh = configuration()
            except (OSError, ssl.SSLError):
                return None
            served["stamp"] = stamp
            return fresh

        return grpc.dynamic_ssl_server_credentials(
            configuration(), fetch, require_client_authentication=s.client_auth == "RequireAndVerifyClientCert"
        )


def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """What the project's clients verify an agent's certificate with: ``ca_file`` (else ``$STAGETRACE_CA_FILE``, else
    the system's CAs), presenting ``$STAGETRACE_CLIENT_CERT_FILE`` / ``_KEY_FILE`` when the agent asks for one."""
    context = ssl.create_default_context(cafile=ca_file or os.environ.get(STAGETRACE_CA_FILE) or None)
    cert = os.environ.get(STAGETRACE_CLIENT_CERT_FILE)
    if cert:
        context.load_cert_chain(cert, os.environ.get(STAGETRACE_CLIENT_KEY_FILE) or None)
    return context


__all__ = ["ServerTLS", "WebConfig", "WebConfigError", "client_context", "load"]
