"""The standard-library HTTP/1.1 server: one thread per connection, keep-alive, JSON and SSE.

Invariants:
- Every response is JSON (errors included), an SSE stream in chunked transfer encoding, a
  CORS preflight's plain "OK" or a redirect's empty body, so a connection stays reusable after
  any response whose request body was fully read. Every response carries the CORS headers of
  its request's Origin.
- A request body is framed by one Content-Length or by chunked transfer encoding, and read only
  while it stays under the size limit (a Content-Length is checked before any byte, chunks as
  their sizes arrive); a rejected body closes the connection instead of being drained.
- Framing is unambiguous before any route runs: what llhttp (uvicorn's parser) refuses -- both
  framings at once, two Content-Lengths, one that is not 1*DIGIT or past 64 bits, a
  Transfer-Encoding whose last coding is not chunked or that repeats it, a request, header,
  chunk-size or trailer line not ended by CRLF alone -- is a 400 that closes. So is a request
  line llhttp refuses (`_request_line_error`: an unknown or lower-case method, PRI, a version
  but 0.9 / 1.0 / 1.1 / 2.0, a separator but spaces); a method it knows reaches the router.
  An HTTP/1.0 request in chunked encoding is served, then its connection closes (RFC 9112 6.1).
- Routes see the percent-decoded path (uvicorn's scope["path"], which Starlette routes on:
  `%2F` is a "/" there too, and a leading "//" stays); the query stays as sent.
- A "close" among a request's Connection options ends the connection after its answer.
- Socket timeouts: `keep_alive_timeout` while waiting for the next request line, `io_timeout` for
  reading a body and for every write (a stuck streaming client fails its write and is aborted).
  The request line and headers must be complete within `keep_alive_timeout + io_timeout`,
  and so must a TLS handshake (HTTPS: `tls.py`).
"""

from __future__ import annotations

import contextlib
import email.errors
import errno
import json
import logging
import math
import os
import re
import select
import socket
import ssl
import stat
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlsplit

from paged_engine.unicode_text import find_lone_surrogate, surrogate_message
from paged_server import __version__
from paged_server.cors import CorsPolicy
from paged_server.errors import APIError, bad_request
from paged_server.tls import TLS

log = logging.getLogger("paged_server")

_DIGITS = re.compile(r"[0-9]+")
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
# A chunk-size line as llhttp (strict, uvicorn's default) takes it: hex digits under 2**64 (any
# leading zeros), extensions `;name[=token|quoted-string]` with no whitespace, then CRLF. A bare
# CR or LF anywhere in it is refused: a proxy in front that reads the line otherwise would
# frame the chunk data otherwise (request smuggling through chunk lines).
_CHUNK_LINE = re.compile(
    rb"([0-9A-Fa-f]+)(?:;" + _TOKEN + rb"(?:=(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?)*\r\n"
)
# a trailer field line: name, colon, a value of visible characters, spaces and tabs; CRLF
_TRAILER_LINE = re.compile(_TOKEN + rb":[\t -~\x80-\xff]*\r\n")
_MAX_LINE = 4096  # a chunk-size or trailer line
_MAX_BLANK_LINES = 8  # skipped before a request line
_ACCEPT_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_PAUSE = 0.5  # seconds between accepts while out of descriptors
_ACCEPT_REMIND = 60.0  # seconds between "still cannot accept" warnings while that lasts
_MAX_LENGTH_DIGITS = 20  # a Content-Length under 2**64 (llhttp's limit), leading zeros aside
_BAD_VALUE = re.compile(r"[\r\n\x00]")  # a folded line or a NUL in a header value
# what a redirect's Location keeps as it is (Starlette's RedirectResponse: the rest is
# percent-encoded, "%" included among the kept)
_LOCATION_SAFE = ":/%#?=@[]!$&'()*+,;"
# what the email parser notes of a header section it read in part (a multipart Content-Type
# adds defects of its own, about the body it expected: not ours to judge)
_HEADER_DEFECTS = (
    email.errors.MissingHeaderBodySeparatorDefect,
    email.errors.InvalidHeaderDefect,
    email.errors.FirstHeaderLineIsContinuationDefect,
)


def _framing_error(headers: Any) -> str | None:
    """Why a request's framing headers are ambiguous, else None: what llhttp (the parser behind
    uvicorn, so vLLM's server) refuses before the app sees the request, each a request-smuggling
    vector when a proxy in front frames the message otherwise (RFC 9112 6.1, 6.3)."""
    te = headers.get_all("Transfer-Encoding") or []
    lengths = headers.get_all("Content-Length") or []
    if te and lengths:
        return "a request must not carry both Content-Length and Transfer-Encoding"
    if len(lengths) > 1:
        return "a request must carry one Content-Length"
    if lengths:
        if not _DIGITS.fullmatch(lengths[0].strip(" \t")):
            return f"invalid Content-Length {lengths[0]!r:.60}"
        digits = _significant(lengths[0])
        if len(digits) > _MAX_LENGTH_DIGITS or int(digits) >= 1 << 64:
            return "Content-Length overflow"
    if te:
        codings = _codings(te)
        if codings[-1] != "chunked" or "chunked" in codings[:-1]:
            return f"invalid Transfer-Encoding {', '.join(te)!r:.60}: chunked must end it, once"
    return None


def _codings(te: list[str]) -> list[str]:
    """The codings of a request's Transfer-Encoding headers, in order, lowercased ("" for an
    empty one, which no valid framing holds). Spaces and tabs before a coding are dropped, only
    spaces after it: llhttp (httptools, the parser uvicorn picks under vLLM, whose fastapi[standard]
    installs it) reads "chunked\t" as another coding, so a request ending so is a 400 there and
    here. (h11, uvicorn's fallback, drops the tab as whitespace around the value.)"""
    return [c.lstrip(" \t").rstrip(" ").lower() for value in te for c in value.split(",")]


def _request_line_error(line: bytes) -> str | None:
    """Why llhttp would refuse a request line (a 400 that closes), else None. A line without a
    version ("GET /x", HTTP/0.9's form) is left to the base class, as is "GET / HTTP/2.0": llhttp
    takes it as an HTTP/1 message of version 2.0, the base class answers 505 (kept: no HTTP/2
    is spoken over an HTTP/1 request line, and llhttp reads 2.0 without keep-alive while uvicorn
    keeps the connection, whose next request its parser then drops unanswered)."""
    match = _REQUEST_LINE.fullmatch(line)
    if match is None:
        if _HTTP09_LINE.fullmatch(line) or not line.endswith(b"\r\n"):
            return None  # the base class's to judge, or the CRLF check's
        return "malformed request line: METHOD SP target SP HTTP/x.y CRLF expected"
    method, target, major, minor = match.groups()
    if method == b"PRI":  # HTTP/2's connection preface (prior knowledge): llhttp stops there
        return "HTTP/2 is not served here (no h2c): speak HTTP/1.1"
    if method.decode() not in _METHODS:
        return f"invalid method {method.decode()[:40]!r}"
    if method != b"CONNECT" and not _TARGET.fullmatch(target):
        return f"invalid request target {target.decode()[:60]!r}"
    if (int(major), int(minor)) not in _VERSIONS:
        return f"invalid HTTP version HTTP/{major.decode()}.{minor.decode()}"
    return None


def _target_path(target: str) -> tuple[str, str]:
    """A request target's path as sent (what logs show: decoded, it may hold a CR, LF or NUL)
    and percent-decoded, as uvicorn hands it to Starlette's routing (invalid UTF-8 becomes
    U+FFFD). Routes still match exactly: no dot segment or repeated "/" is folded away."""
    if target.startswith("/"):  # origin-form: "//host/x" too (urlsplit reads an authority)
        raw = target.partition("?")[0].partition("#")[0]
    else:  # absolute-form ("http://h/x"), or "*"
        raw = urlsplit(target).path
    return raw, (unquote(raw) if "%" in raw else raw)


def _target_query(target: str) -> str:
    """A request target's query as sent, "" when it has none."""
    if target.startswith("/"):
        return target.partition("#")[0].partition("?")[2]
    return urlsplit(target).query


def _significant(length: str) -> str:
    """A valid Content-Length's digits without leading zeros (int() refuses a string of over
    4300 digits, and a header line may hold 64 KiB of zeros)."""
    return length.strip(" \t").lstrip("0") or "0"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _infinite_path(value: Any) -> str:
    """The path ("a.b[2]") of the first infinite float under `value`, walked without recursion
    (JSON may nest deeply); "" for the value itself."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and math.isinf(item):
            return path
        if isinstance(item, dict):
            subs = [(sub, f"{path}.{key}" if path else str(key)) for key, sub in item.items()]
        elif isinstance(item, list):
            subs = [(sub, f"{path}[{i}]") for i, sub in enumerate(item)]
        else:
            continue
        stack.extend(reversed(subs))
    return ""


def parse_json_body(data: bytes | str, invalid: str = "Invalid JSON body") -> Any:
    """A request body as every route takes it: JSON (RFC 8259: NaN / Infinity are Python's
    extensions, refused like any other malformed body, as is a number past a double's range
    (1e999), so no non-finite number reaches a schema or a response) without lone surrogates
    (valid JSON, invalid Unicode: every route's text reaches a tokenizer, a template or a log,
    and none takes one); else a 400 (`invalid`: how its message starts when the text is not
    JSON)."""
    past_range: list[str] = []  # numbers past a double's range (1e999): float() gives inf

    def number(text: str) -> float:
        value = float(text)
        if math.isinf(value):
            past_range.append(text)
        return value

    try:
        body = json.loads(data, parse_constant=_reject_constant, parse_float=number)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"{invalid}: {e}") from None
    if past_range:
        path = _infinite_path(body)
        msg = f"{path or 'the body'}: the number {past_range[0][:50]} is past a double's range"
        raise bad_request(msg, path or None)
    found = find_lone_surrogate(body, "")
    if found is not None:
        path, at, char = found
        raise bad_request(surrogate_message(path or "the body", at, char), path or None)
    return body


class App(Protocol):
    def dispatch(self, handler: Handler, method: str, path: str) -> None: ...

    def record(self, path: str, status: int) -> None: ...


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # listen backlog: hundreds of clients may connect at once

    def __init__(
        self,
        address: tuple[str, int] | str,
        app: App | None,
        *,
        max_body_bytes: int = 16 << 20,
        keep_alive_timeout: float = 5.0,
        io_timeout: float = 30.0,
        listen: bool = True,
        cors: CorsPolicy | None = None,
        tls: TLS | None = None,
        access_log: bool = True,
        request_id_headers: bool = False,
        log_error_stack: bool = False,
    ):
        """`address`: (host, port), or a path: a Unix domain socket (a stale socket file there
        is replaced). `listen=False` only binds (the port is taken, connections are refused):
        set `app`, then call `server_activate()` before serving. `cors` None: no CORS headers
        at all. `tls`: every connection speaks HTTPS. `access_log`: one INFO line per request (else
        DEBUG). `request_id_headers`: every answer carries X-Request-Id (the request's, else
        a new one). `log_error_stack`: every error answer (4xx too) logs where it was raised."""
        self.app = app
        self.log_error_stack = log_error_stack
        self.access_log = access_log
        self.request_id_headers = request_id_headers
        self.cors = cors
        self.tls = tls
        self.max_body_bytes = max_body_bytes
        self.keep_alive_timeout = keep_alive_timeout
        self.io_timeout = io_timeout
        self.accepting = True
        # accept() out of descriptors: (since, accepts refused, last warning), on the accept
        # loop's thread only; None while accepts succeed
        self._exhausted: tuple[float, int, float] | None = None
        self._active = 0
        self._active_lock = threading.Lock()
        # Connections between "waiting for a request line" and "headers parsed", with the time
        # by which they must be done: a client trickling header bytes cannot hold a thread.
        self._reading: dict[Handler, float] = {}
        self._reading_lock = threading.Lock()
        if isinstance(address, str):
            self.address_family = socket.AF_UNIX
        super().__init__(address, Handler, bind_and_activate=False)
        try:
            self.server_bind()
            if listen:
                self.server_activate()
        except BaseException:
            self.server_close()
            raise
        threading.Thread(target=self._reap_slow_headers, name="http-reaper", daemon=True).start()

    @property
    def unix(self) -> bool:
        return self.address_family == socket.AF_UNIX

    def server_bind(self) -> None:
        if not self.unix:
            return super().server_bind()
        path = self.server_address
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(path).st_mode):  # a server before this one left it
                os.unlink(path)
        self.socket.bind(path)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = "localhost", 0

    def get_request(self) -> tuple[Any, Any]:
        try:
            conn, addr = super().get_request()
        except OSError as e:
            # Out of descriptors or memory: the listening socket stays readable, so retrying at
            # once would spin the accept loop; pause as asyncio's servers do (the OSError makes
            # socketserver skip this round).
            if e.errno in _ACCEPT_EXHAUSTED:
                self._accept_refused(e)
                time.sleep(_ACCEPT_PAUSE)
            raise
        if self._exhausted is not None:
            since, refused, _ = self._exhausted
            self._exhausted = None
            log.warning(
                "accepting connections again after %.1f s (%d accepts refused)",
                time.monotonic() - since,
                refused,
            )
        return conn, (("unix", 0) if self.unix else addr)  # handlers log client_address[0]

    def _accept_refused(self, e: OSError) -> None:
        """Count a refused accept; warn when an episode of them starts, then once per
        _ACCEPT_REMIND while it lasts (not at every retry: twice a second)."""
        now = time.monotonic()
        if self._exhausted is None:
            self._exhausted = (now, 1, now)
            log.warning("cannot accept connections: %s; retrying every %.1f s", e, _ACCEPT_PAUSE)
            return
        since, refused, warned = self._exhausted
        if now - warned >= _ACCEPT_REMIND:
            log.warning("still cannot accept connections after %.0f s: %s", now - since, e)
            warned = now
        self._exhausted = (since, refused + 1, warned)

    def server_close(self) -> None:
        super().server_close()
        if self.unix and isinstance(self.server_address, str):
            with contextlib.suppress(OSError):
                os.unlink(self.server_address)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def finish_request(self, request: Any, client_address: Any) -> None:
        """On the connection's own thread: the TLS handshake (one deadline for all of it: the
        ssl module bounds the whole handshake by the socket timeout), then the handler. A failed
        handshake (a plain-HTTP client, a refused client certificate) closes that connection
        alone."""
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(self.keep_alive_timeout + self.io_timeout)
        try:  # wrap_socket detaches `request`: the TLS socket owns the connection from here
            conn = self.tls.context.wrap_socket(
                request, server_side=True, do_handshake_on_connect=False
            )
        except OSError as e:
            log.info("%s: TLS setup failed: %s", client_address[0], e)
            return None
        try:
            conn.do_handshake()
        except (ssl.SSLError, OSError) as e:
            log.info("%s: TLS handshake failed: %s", client_address[0], e)
            self.shutdown_request(conn)
            return None
        try:
            super().finish_request(conn, client_address)
        finally:
            self.shutdown_request(conn)
        return None

    def active_requests(self) -> int:
        return self._active

    def track(self, delta: int) -> None:
        with self._active_lock:
            self._active += delta

    def reading(self, handler: Handler, started: bool) -> None:
        with self._reading_lock:
            if started:
                self._reading[handler] = (
                    time.monotonic() + self.keep_alive_timeout + self.io_timeout
                )
            else:
                self._reading.pop(handler, None)

    def _reap_slow_headers(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self._reading_lock:
                late = [h for h, deadline in self._reading.items() if deadline < now]
                for h in late:
                    del self._reading[h]
            for h in late:
                log.info("%s: request headers too slow; closing", h.client_address[0])
                with contextlib.suppress(OSError):
                    # the TCP socket's own shutdown: an SSLSocket's would drop its TLS state
                    # under the handler thread still reading it
                    socket.socket.shutdown(h.connection, socket.SHUT_RDWR)


_UNREAD = object()  # Handler._json before the body is read
# The request methods llhttp (httptools, uvicorn's parser under vLLM) takes on an HTTP/x.x
# request line, case-sensitive (its METHODS_HTTP1): any other word is a 400 there, and a
# method a route lacks reaches Starlette's router (405, or 404 for an unknown path).
_METHODS = frozenset({
    "DELETE", "GET", "HEAD", "POST", "PUT", "CONNECT", "OPTIONS", "TRACE", "PATCH", "LINK",
    "UNLINK", "COPY", "LOCK", "MKCOL", "MOVE", "PROPFIND", "PROPPATCH", "SEARCH", "UNLOCK", "BIND",
    "REBIND", "UNBIND", "ACL", "REPORT", "MKACTIVITY", "CHECKOUT", "MERGE", "M-SEARCH", "NOTIFY",
    "SUBSCRIBE", "UNSUBSCRIBE", "MKCALENDAR", "PURGE", "QUERY", "SOURCE",
})  # fmt: skip
# A request line as llhttp (strict, its default) reads it: a method, spaces (one or more), a
# target of visible ASCII, spaces, HTTP/<digit>.<digit>, CRLF. A tab, a space before the method
# or the CRLF, a byte past 0x7E or a control byte in the target, "http/1.1" or "HTTP/1.10" do not.
_REQUEST_LINE = re.compile(rb"([!-~]+) +([!-~]+) +HTTP/([0-9])\.([0-9])\r\n")
_HTTP09_LINE = re.compile(rb"[!-~]+ +[!-~]+\r\n")  # "GET /path": no version (the base class's)
# origin-form ("/x", or "*") or absolute-form ("http://h/x"); CONNECT takes an authority
_TARGET = re.compile(rb"[/*].*|[A-Za-z]+://.*", re.S)
_VERSIONS = ((0, 9), (1, 0), (1, 1), (2, 0))  # llhttp's; any other is a 400 there
_LINE_END = re.compile(rb"[^\r\n]*\r\n")  # a request or header line, CRLF-ended, no other CR


class _CheckedLines:
    """A request's reader for the base class's header parsing: notes a line that does not end
    in CRLF or holds another CR (`malformed`); the line itself is returned as read."""

    def __init__(self, rfile: Any) -> None:
        self.rfile = rfile
        self.malformed = False

    def readline(self, limit: int = -1) -> bytes:
        line = self.rfile.readline(limit)
        if line and not _LINE_END.fullmatch(line):
            self.malformed = True
        return line

    def __getattr__(self, name: str) -> Any:  # any other read the parser may make
        return getattr(self.rfile, name)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # answer garbage with a status line, not HTTP/0.9
    server_version = f"paged-server/{__version__}"
    sys_version = ""
    server: Server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cors_headers: dict[str, str] = {}  # this request's CORS response headers
        super().__init__(*args, **kwargs)  # serves the connection

    def version_string(self) -> str:
        return self.server_version  # the base class appends " " + sys_version

    def end_headers(self) -> None:
        for k, v in self.cors_headers.items():
            self.send_header(k, v)
        if self.server.request_id_headers:
            headers = getattr(self, "headers", None)  # absent when the request line was bad
            rid = headers.get("X-Request-Id", "") if headers is not None else ""
            ok = 0 < len(rid) <= 256 and rid.isprintable()
            self.send_header("X-Request-Id", rid if ok else uuid.uuid4().hex)
        super().end_headers()

    # ---- request loop ----------------------------------------------------------------------
    def handle_one_request(self) -> None:
        self.server.reading(self, True)
        self.expect_continue = False  # set by handle_expect_100 while the headers are parsed
        self.cors_headers = {}  # set once the headers are parsed
        try:
            self.connection.settimeout(self.server.keep_alive_timeout)
            super().handle_one_request()
        except (TimeoutError, ConnectionError, OSError):
            self.close_connection = True
        finally:
            self.server.reading(self, False)

    def parse_request(self) -> bool:
        """The base parser, then a 400 that closes for a header section it read only in part:
        the email parser behind it takes a line without a colon for the end of the headers
        (silently dropping those after it, Content-Length included, so the body would be read
        as the next request) and keeps folded lines and NUL bytes in values (RFC 9112 5.2,
        RFC 9110 5.5: reject them), and for ambiguous framing (`_framing_error`). Blank lines
        before the request line are skipped (RFC 9112 2.2: some clients send a CRLF after a
        body; without this the next request on the connection is dropped unanswered).

        The request line and every header line must end in CRLF and hold no other CR (llhttp,
        strict as uvicorn runs it, refuses the rest): the email parser ends a line at a bare CR
        or LF as well, so "X: a<CR>Content-Length: 36" would frame a body that a proxy passing
        the CR along never sent. Routes see the target as sent: the base class folds a leading
        "//" into "/", which would serve "//v1/models" (Starlette: 404) and let a path a proxy in
        front refuses ("/sleep") through as "//sleep"."""
        for _ in range(_MAX_BLANK_LINES):
            if self.raw_requestline not in (b"\r\n", b"\n"):
                break
            self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:  # the base class's check, for the line read here
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return False
        error = _request_line_error(self.raw_requestline)
        if error is not None:  # answered before the base class reads (or 505s) anything
            self.requestline = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n")
            self.request_version = self.command = ""
            self.send_error(400, error)
            return False
        if self.raw_requestline.endswith(b" HTTP/0.9\r\n"):
            # llhttp takes the version and uvicorn answers with a status line and headers, as
            # to HTTP/1.0 (the base class would answer HTTP/0.9's way: a bare body)
            self.raw_requestline = self.raw_requestline[:-10] + b" HTTP/1.0\r\n"
        lines = _CheckedLines(self.rfile)
        self.rfile = lines  # the base class reads the header lines through it
        try:
            if not super().parse_request():
                return False
        finally:
            self.rfile = lines.rfile
        self.path = self.requestline.split()[1]  # parsed: two or three words
        if not _LINE_END.fullmatch(self.raw_requestline):
            self.send_error(400, "malformed request line: it must end in CRLF, with no other CR")
            return False
        if (
            lines.malformed
            or any(isinstance(d, _HEADER_DEFECTS) for d in self.headers.defects)
            or any(_BAD_VALUE.search(v) for v in self.headers.values())
        ):
            self.send_error(400, "malformed header line")
            return False
        error = _framing_error(self.headers)
        if error is not None:
            self.send_error(400, error)
            return False
        # Connection is a list of options, over any number of lines (RFC 9110 7.6.1): "close"
        # anywhere ends the connection after this answer, no request after it served (RFC 9112
        # 9.6; the base class reads the first line alone, and only when it is that one word).
        lines = self.headers.get_all("Connection") or []
        options = {o.strip(" \t").lower() for line in lines for o in line.split(",")}
        if "close" in options:
            self.close_connection = True
        elif "keep-alive" in options and self.request_version == "HTTP/1.0":
            self.close_connection = False
        if self.command == "CONNECT":
            # llhttp hands whatever follows a CONNECT's headers to another protocol (a tunnel),
            # never parsing it as the next request: the route's answer (404, 405) ends it here
            self.close_connection = True
        if self.request_version == "HTTP/1.0" and "Transfer-Encoding" in self.headers:
            # RFC 9112 6.1: framing an HTTP/1.0 peer may not have meant; the body is read as
            # chunked (llhttp and h11 do), and the connection ends with the answer (as uvicorn
            # ends every HTTP/1.0 one)
            self.close_connection = True
        return True

    def __getattr__(self, name: str) -> Any:
        """`do_<METHOD>` for llhttp's other methods (the base class answers a method without
        one 501): they reach the router, which answers 405 or 404 as Starlette does."""
        if name.startswith("do_") and name[3:] in _METHODS:
            return lambda: self._handle(name[3:])
        raise AttributeError(name)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_OPTIONS(self) -> None:
        self._handle("OPTIONS")

    def _handle(self, method: str) -> None:
        self.server.reading(self, False)  # headers are in
        self.connection.settimeout(self.server.io_timeout)
        self.t_start = time.monotonic()
        self.status = 0
        self.headers_sent = False
        self.streaming = False
        self.log_extra = ""
        self.body_read = False
        self._json: Any = _UNREAD  # the parsed body, once read_json has read it
        raw, path = _target_path(self.path)  # logged as sent, routed decoded
        self.server.track(1)
        cors, origin = self.server.cors, self.headers.get("Origin")
        self.cors_headers = cors.response_headers(origin) if cors is not None else {}
        try:
            if cors is not None and origin and method == "OPTIONS":
                wanted = self.headers.get("Access-Control-Request-Method")
                if wanted is not None:
                    return self._preflight(cors, origin, wanted)
            if not self.server.accepting:
                self.close_connection = True
                raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
            self.server.app.dispatch(self, method, path)
        except APIError as e:
            if self.server.log_error_stack:  # vLLM's --log-error-stack
                log.warning("%s %s answered %d: %s", method, raw, e.status, e.message, exc_info=e)
            self._send_error(e)
        except (TimeoutError, ConnectionError, ssl.SSLError):  # the client went away
            self.close_connection = True
        except Exception:
            log.exception("unhandled error in %s %s", method, raw)
            self._send_error(APIError(500, "internal server error"))
        finally:
            self.server.track(-1)
            self.server.app.record(path, self.status)
            dt = time.monotonic() - self.t_start
            log.log(
                logging.INFO if self.server.access_log else logging.DEBUG,
                "%s %s %s %d %.3fs%s",
                self.client_address[0],
                method,
                raw,
                self.status,
                dt,
                self.log_extra,
            )

    def _preflight(self, cors: CorsPolicy, origin: str, method: str) -> None:
        status, headers, error = cors.preflight(
            origin, method, self.headers.get("Access-Control-Request-Headers")
        )
        self.cors_headers = {}  # the preflight's own headers hold them
        if error:
            raise APIError(status, error, code="cors_not_allowed", headers=headers)
        self.send_bytes(200, b"OK", "text/plain; charset=utf-8", headers)

    # ---- request bodies --------------------------------------------------------------------
    def handle_expect_100(self) -> bool:
        """`Expect: 100-continue`: the interim 100 goes out only when a route reads the body, so
        a request refused first (401, 413, ...) is answered before the client uploads it."""
        self.expect_continue = True
        return True

    def has_body(self) -> bool:
        return "Transfer-Encoding" in self.headers or (
            _significant(self.headers.get("Content-Length", "0")) != "0"
        )

    def read_json(self) -> Any:
        """The request's JSON body, parsed and checked once (a second call returns it again:
        /invocations reads it to choose the route that reads it)."""
        if self._json is not _UNREAD:
            return self._json
        self._check_json_type()
        data = self._read_body()
        self.body_read = True
        self._json = parse_json_body(data)
        return self._json

    def _check_json_type(self) -> None:
        """A JSON route takes `application/json`, a `+json` type or no Content-Type at all; any
        other type is a 415 naming the header, as in vLLM (which answers 400). This refuses the
        form and text/plain bodies a browser page may send cross-origin without a preflight."""
        ctype = self.headers.get("Content-Type")
        if ctype is None:
            return
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (
            media.startswith("application/") and media.endswith("+json")
        ):
            self.close_connection = True  # the body stays unread
            form = media == "application/x-www-form-urlencoded"  # curl -d's default
            hint = "; curl -d sends that: add -H 'Content-Type: application/json'" if form else ""
            raise APIError(
                415,
                f"the body must be JSON with Content-Type: application/json, got {ctype!r:.200}"
                + hint,
                param="Content-Type",
                code="unsupported_media_type",
            )

    def read_body(self) -> bytes:
        """The request's raw body (a multipart upload's), read once with read_json's framing
        and size limit."""
        data = self._read_body()
        self.body_read = True
        return data

    def _read_body(self) -> bytes:
        """The body framed by Transfer-Encoding: chunked or by its one Content-Length
        (parse_request refused any other framing). A coding before chunked ("gzip, chunked",
        which llhttp lets through) is a 501 that closes: no coding but chunked is undone."""
        te = self.headers.get_all("Transfer-Encoding")
        if te:
            codings = _codings(te)
            keep_open = not self.close_connection
            self.close_connection = True  # until the body is read to its end
            if codings != ["chunked"]:
                raise APIError(
                    501,
                    f"unsupported Transfer-Encoding {', '.join(codings)!r}; use chunked or "
                    "Content-Length",
                    code="unsupported_transfer_encoding",
                )
            self._continue()
            data = self._read_chunked()
            self.close_connection = not keep_open
            return data
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise APIError(411, "a JSON body with Content-Length (or chunked) is required")
        length = int(_significant(length_text))
        self._check_size(length)
        self._continue()
        return self._read_exact(length, time.monotonic() + self.server.io_timeout)

    def _check_size(self, length: int) -> None:
        if length > self.server.max_body_bytes:
            self.close_connection = True
            raise APIError(
                413,
                f"request body of {length} bytes exceeds the limit of "
                f"{self.server.max_body_bytes} bytes",
                code="request_too_large",
            )

    def _continue(self) -> None:
        if self.expect_continue:
            self.expect_continue = False
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()

    def _read_chunked(self) -> bytes:
        """A chunked body (extensions checked and ignored, trailer fields checked and dropped,
        every line ended by CRLF as llhttp requires), under the body size limit and one
        io_timeout in total. Gathered in one buffer: a list of parts would cost ~60 bytes of
        memory per 1-byte chunk (a 16 MiB body of them: ~1 GiB)."""
        deadline = time.monotonic() + self.server.io_timeout
        data = bytearray()
        while True:
            line = self._read_line(deadline)
            match = _CHUNK_LINE.fullmatch(line)
            if match is None or len(match[1].lstrip(b"0")) > 16:
                raise bad_request(f"invalid chunk size line {line[:40]!r}")
            size = int(match[1], 16)
            if size == 0:
                break
            self._check_size(len(data) + size)
            data += self._read_exact(size, deadline)
            if self._read_exact(2, deadline) != b"\r\n":
                raise bad_request("a chunk must end with CRLF")
        while (line := self._read_line(deadline)) != b"\r\n":  # trailer fields, dropped
            if not _TRAILER_LINE.fullmatch(line):
                raise bad_request(f"invalid trailer line {line[:40]!r}")
        return bytes(data)

    def _read_line(self, deadline: float) -> bytes:
        """One chunk-size or trailer line by `deadline`, checked between receives as in
        _read_exact (readline alone would wait io_timeout per byte of a trickled line)."""
        line = bytearray()
        while True:
            self._check_body_deadline(deadline)
            buffered = self.rfile.peek(1)  # the bytes buffered, else one receive's
            if not buffered:
                raise ConnectionResetError("client closed the connection mid-body")
            room = _MAX_LINE + 1 - len(line)
            end = buffered.find(b"\n", 0, room) + 1
            line += self.rfile.read(end or min(len(buffered), room))
            if len(line) > _MAX_LINE:
                raise bad_request("chunk size or trailer line too long")
            if end:
                return bytes(line)

    def _check_body_deadline(self, deadline: float) -> None:
        """A 408 (closing the connection) once the body's `deadline` has passed."""
        if time.monotonic() > deadline:
            self.close_connection = True
            raise APIError(408, "timed out reading the request body")

    def _read_exact(self, n: int, deadline: float) -> bytes:
        """Read n bytes by `deadline` (a trickling client cannot hold us)."""
        data = bytearray()  # one buffer: a trickled body arrives in many small receives
        while len(data) < n:
            self._check_body_deadline(deadline)
            chunk = self.rfile.read1(min(n - len(data), 1 << 16))
            if not chunk:
                self.close_connection = True
                raise ConnectionResetError("client closed the connection mid-body")
            data += chunk
        return bytes(data)

    # ---- responses -------------------------------------------------------------------------
    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_bytes(
        self,
        status: int,
        body: bytes,
        content_type: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """A whole answer; `content_type` None: none is named (an empty body)."""
        self.status = status
        if not self.body_read and self.has_body():
            self.close_connection = True  # the unread body would be parsed as the next request
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        elif self.request_version == "HTTP/1.0":  # 1.0 persists only when the answer says so
            self.send_header("Connection", "keep-alive")
        self.end_headers()
        self.headers_sent = True
        if self.command != "HEAD":
            self.wfile.write(body)

    def redirect(self, path: str) -> None:
        """A 307 to `path` (decoded, as routes see it) with the request's query, empty, as
        Starlette's redirect_slashes answers a path that matches only without its trailing "/"
        (starlette/routing.py Router.app, datastructures.URL(scope=...)): Location is absolute,
        its authority the Host header's, else the address the client reached; clients repeat
        the method and body there (RFC 9110 15.4.8)."""
        host = self.headers.get("Host")
        if host is not None:
            url = f"{self.server.scheme}://{host}{path}"
        elif self.server.unix:
            url = path
        else:
            addr, port = self.connection.getsockname()[:2]
            addr = f"[{addr}]" if ":" in addr else addr
            default = 443 if self.server.tls is not None else 80
            url = f"{self.server.scheme}://{addr}{'' if port == default else f':{port}'}{path}"
        query = _target_query(self.path)
        location = quote(url + (f"?{query}" if query else ""), safe=_LOCATION_SAFE)
        self.send_bytes(307, b"", None, {"Location": location})

    def _send_error(self, e: APIError) -> None:
        if self.headers_sent:  # mid-stream: report in-band, then end the stream
            if self.streaming:
                try:
                    self.send_event(json.loads(e.body()))
                    self.end_stream()
                except OSError:
                    self.close_connection = True
            return
        try:
            self.send_bytes(e.status, e.body(), "application/json", e.headers)
        except OSError:
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors raised by BaseHTTPRequestHandler itself, as JSON."""
        self.close_connection = True
        self.status = code
        body = APIError(code, message or self.responses.get(code, ("error",))[0]).body()
        try:
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except OSError:
            pass

    def start_stream(self) -> None:
        """SSE in chunked encoding; HTTP/1.0 clients get a raw stream ended by closing."""
        self.status = 200
        self.streaming = True
        self.chunked = self.request_version != "HTTP/1.0"
        self.close_connection = self.close_connection or not self.chunked
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self.headers_sent = True
        self.wfile.flush()

    def send_event(self, obj: Any, event: str | None = None) -> None:
        """One SSE event: `event: <event>` when named (the Responses API's typed events), then
        `data: <obj>` (bytes as they are, else JSON); raises OSError if the client went away."""
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        if event is None:
            self.send_chunk(b"data: %s\n\n" % data)
            return
        if not event or any(c in event for c in "\r\n"):
            raise ValueError(f"event must be a non-empty one-line name, got {event!r}")
        self.send_chunk(b"event: %s\ndata: %s\n\n" % (event.encode(), data))

    def send_chunk(self, data: bytes) -> None:
        """Stream bytes as they are (whole SSE events: one HTTP chunk, flushed); raises OSError
        if the client went away. A HEAD request gets the headers alone (RFC 9110 9.3.2: a body
        would be read as the next response on the connection)."""
        if self.command == "HEAD":
            return
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)
        self.wfile.flush()

    def end_stream(self, done: bool = True) -> None:
        """End the stream: after a `data: [DONE]` event when `done` (the completions and chat
        streams' end mark; Responses API streams end without one)."""
        if done:
            self.send_event(b"[DONE]")
        if self.chunked and self.command != "HEAD":
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    # ---- connection state ------------------------------------------------------------------
    def client_gone(self) -> bool:
        """True if the peer closed its side (EOF) or the socket errored; never blocks."""
        try:
            p = select.poll()
            p.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
            events = p.poll(0)
            if not events:
                return False
            if events[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                return True
            if isinstance(self.connection, ssl.SSLSocket):
                return self._tls_peer_closed()
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _tls_peer_closed(self) -> bool:
        """TLS cannot peek: records are read (without blocking) and decrypted. A close_notify
        or EOF means the peer left; a partial record means nothing yet. Request bytes a client
        pipelined behind this request cannot be put back, so the connection closes after this
        response (clients resend an unanswered request on a new connection)."""
        conn = self.connection
        timeout = conn.gettimeout()
        conn.settimeout(0.0)
        try:
            data = conn.recv(1 << 16)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        finally:
            conn.settimeout(timeout)
        if not data:
            return True
        self.close_connection = True
        return False

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)
