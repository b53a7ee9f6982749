"""HTTPS: vLLM's `--ssl-*` flags on the standard library's `ssl` module.

The listening socket stays plain TCP; each accepted connection does its TLS handshake on its own
handler thread (`Server.finish_request`), so a slow or hostile handshake never holds the accept
loop. `TLS.context` is read once per connection: with `refresh`, a watcher thread swaps in a new
context when a key, certificate or CA file changes (a renewed certificate serves new connections
without a restart; connections already open keep theirs).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass

log = logging.getLogger("paged_server")

# vLLM's --ssl-cert-reqs values: the ssl module's verify modes.
CERT_REQS = {
    int(ssl.CERT_NONE): "none",
    int(ssl.CERT_OPTIONAL): "optional",
    int(ssl.CERT_REQUIRED): "required",
}


@dataclass(frozen=True, slots=True)
class TLSConfig:
    keyfile: str
    certfile: str
    ca_certs: str | None = None  # client certificates are verified against these CAs
    cert_reqs: int = int(ssl.CERT_NONE)  # 0 none, 1 optional, 2 required (client certificates)
    ciphers: str | None = None  # an OpenSSL cipher list (TLS 1.2; TLS 1.3 suites are fixed)

    def files(self) -> list[str]:
        return [f for f in (self.keyfile, self.certfile, self.ca_certs) if f]

    def context(self) -> ssl.SSLContext:
        """A server context; ValueError naming the flag whose file or value is refused."""
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(
                f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), "
                f"got {self.cert_reqs}"
            )
        if self.cert_reqs != ssl.CERT_NONE and not self.ca_certs:
            raise ValueError(
                f"--ssl-cert-reqs {self.cert_reqs} verifies client certificates: it needs "
                "--ssl-ca-certs (the CA file they are checked against)"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # TLS 1.2+, no compression
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"--ssl-certfile {self.certfile!r} / --ssl-keyfile {self.keyfile!r}: {e}"
            ) from None
        if self.ca_certs:
            try:
                ctx.load_verify_locations(cafile=self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs {self.ca_certs!r}: {e}") from None
        ctx.verify_mode = ssl.VerifyMode(self.cert_reqs)
        if self.ciphers:
            try:
                ctx.set_ciphers(self.ciphers)
            except ssl.SSLError as e:
                raise ValueError(f"--ssl-ciphers {self.ciphers!r}: {e}") from None
        return ctx


class TLS:
    """The context new connections use; `refresh` reloads it when a file changes."""

    def __init__(self, config: TLSConfig, refresh: bool = False, poll_s: float = 1.0):
        self.config = config
        self.context = config.context()  # ValueError before anything listens
        self._stamps = self._stat()
        self._stop = threading.Event()
        if refresh:
            threading.Thread(
                target=self._watch, args=(poll_s,), name="tls-refresh", daemon=True
            ).start()

    def close(self) -> None:
        self._stop.set()

    def _stat(self) -> list[tuple[int, int] | None]:
        stamps: list[tuple[int, int] | None] = []
        for f in self.config.files():
            try:
                st = os.stat(f)
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append(None)
        return stamps

    def _watch(self, poll_s: float) -> None:
        failed: list[tuple[int, int] | None] | None = None  # the stamps that last failed
        while not self._stop.wait(poll_s):
            stamps = self._stat()
            if stamps == self._stamps:
                continue
            try:
                self.context = self.config.context()
            except ValueError as e:
                # A half-written renewal fails to load: the old context serves on, and the next
                # change of any file is tried again.
                if stamps != failed:
                    log.warning("TLS: keeping the current certificate: %s", e)
                    failed = stamps
                continue
            self._stamps = stamps
            log.info("TLS: reloaded %s", ", ".join(self.config.files()))
