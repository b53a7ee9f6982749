"""A connection to an engine replica whose answer must arrive by a deadline (the data-parallel
front's, data_parallel.py). The socket timeout alone bounds one receive, so a replica sending a
byte now and then would hold its reader forever: here every receive counts against a deadline
(`ReplicaConnection.expect`), and, while the front waits, whether its own client is still
there is asked every WATCH_INTERVAL (`watch`), so an abandoned request ends on the replica too.

`ReplicaPool` keeps a replica's HTTP/1.1 keep-alive connections for the next request (a new
loopback connection per request leaves its port in TIME_WAIT for a minute: at a few hundred
requests a second the front runs out of ports). Only a connection whose answer was read to its
end, and which the replica keeps open, goes back; an abandoned or failed one is closed.
"""

from __future__ import annotations

import collections
import http.client
import io
import math
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

WATCH_INTERVAL = 0.25  # seconds between checks that a waiting client is still there (app.py's)
POOL_SIZE = 32  # idle keep-alive connections kept per replica


class ClientGone(ConnectionResetError):
    """The client left while the front waited on its replica's answer."""


class _ReplicaSocket:
    """A connected replica socket whose reads (through `makefile`, as http.client reads an
    answer) each end by `deadline` (monotonic seconds): the socket timeout alone bounds one
    receive, so a replica sending a byte a little faster than that would hold its reader
    forever. Past the deadline a read raises TimeoutError; with `client_gone` set, a read waiting
    on the replica raises `ClientGone` once that returns True (asked every `WATCH_INTERVAL`).
    As a socket's, `close` waits for the readers made from it to close (http.client closes the
    connection before reading the body of an answer that ends it)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline = float("inf")
        self.client_gone: Callable[[], bool] | None = None
        self._readers = 0
        self._closing = False
        self.received = 0  # bytes read from the replica since the last `expect`

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        assert mode == "rb", mode
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def recv_into(self, buf: Any) -> int:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the replica's answer is past its deadline")
            if self.client_gone is None:
                self._sock.settimeout(None if left == math.inf else left)  # no deadline set
                n = self._sock.recv_into(buf)
                self.received += n
                return n
            self._sock.settimeout(min(left, WATCH_INTERVAL))
            try:
                n = self._sock.recv_into(buf)
                self.received += n
                return n
            except TimeoutError:  # nothing received (a timed-out recv consumes nothing)
                if self.client_gone():
                    raise ClientGone("client disconnected") from None

    def release(self) -> None:
        self._readers -= 1
        if self._closing and not self._readers:
            self._sock.close()

    def close(self) -> None:
        self._closing = True
        if not self._readers:
            self._sock.close()

    def close_now(self) -> None:
        self._closing = True
        self._sock.close()

    def dropped(self) -> bool:
        """True if an idle connection can serve no next request: the replica closed it (EOF) or
        sent bytes no request asked for, or the socket failed. Never blocks."""
        if self._closing:
            return True
        try:
            p = select.poll()
            p.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def __getattr__(self, name: str) -> Any:  # sendall, setsockopt, ...: the socket's
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """One reader of a `_ReplicaSocket`."""

    def __init__(self, owner: _ReplicaSocket) -> None:
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        return self.owner.recv_into(buf)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.owner.release()


class ReplicaConnection(http.client.HTTPConnection):
    """A connection to a replica whose answer must arrive by a deadline (`expect`), not only
    with no gap past `timeout` between receives."""

    reads: _ReplicaSocket | None = None
    answers = 0  # answers read to their end on this connection (more than 0: a pooled one)

    def connect(self) -> None:
        super().connect()
        # kept here too: http.client drops `sock` when an answer ends the connection, and
        # that answer's reader reads on
        self.sock = self.reads = _ReplicaSocket(self.sock)

    def done(self) -> None:
        """Close the connection and the socket itself, a reader of its answer left open or not
        (a client gone mid-stream: the replica sees its connection end, and aborts)."""
        self.close()
        if self.reads is not None:
            self.reads.close_now()

    def expect(self, seconds: float) -> None:
        """Every read from now on ends within `seconds` of now (once connected)."""
        assert self.reads is not None, "connect first"
        self.reads.deadline = time.monotonic() + seconds
        self.reads.received = 0

    def watch(self, client_gone: Callable[[], bool]) -> None:
        """Reads waiting on the replica end (`ClientGone`) once `client_gone()` is True."""
        assert self.reads is not None, "connect first"
        self.reads.client_gone = client_gone


class ReplicaPool:
    """One replica's idle keep-alive connections, at most `size`; each is reused only within
    `idle_timeout` seconds of its last answer (under the replica's --timeout-keep-alive, so the
    replica rarely closes one as a request goes out on it: that race is the caller's to retry,
    `ReplicaRouter._send`). Thread-safe; a connection is used by one request at a time."""

    def __init__(
        self,
        connect: Callable[[float], ReplicaConnection],
        *,
        size: int = POOL_SIZE,
        idle_timeout: float = 4.0,
    ) -> None:
        self._connect = connect
        self.size = size
        self.idle_timeout = idle_timeout
        self._idle: collections.deque[tuple[float, ReplicaConnection]] = collections.deque()
        self._lock = threading.Lock()

    def get(self, timeout: float, *, fresh: bool = False) -> ReplicaConnection:
        """The most recently used idle connection that still serves, else (or with `fresh`) a
        new one, not yet connected. `timeout` bounds the connect and each send."""
        while not fresh:
            with self._lock:
                if not self._idle:
                    break
                since, conn = self._idle.pop()
            assert conn.reads is not None
            if time.monotonic() - since < self.idle_timeout and not conn.reads.dropped():
                conn.timeout = timeout
                conn.reads.settimeout(timeout)  # sendall's bound (a read sets its own)
                return conn
            conn.done()
        return self._connect(timeout)

    def release(self, conn: ReplicaConnection, resp: http.client.HTTPResponse) -> None:
        """Back to the pool when `resp` was read to its end (no exception on the way) and the
        replica keeps the connection open; else closed."""
        reads = conn.reads
        whole = resp.isclosed() and not resp.will_close  # else: unread bytes, or no keep-alive
        if not whole or reads is None or conn.sock is None or self.size < 1:
            return conn.done()
        conn.answers += 1
        reads.deadline, reads.client_gone = math.inf, None  # the last request's handler
        now = time.monotonic()
        with self._lock:
            while self._idle and (
                len(self._idle) >= self.size or now - self._idle[0][0] >= self.idle_timeout
            ):
                self._idle.popleft()[1].done()  # the oldest: the first to expire
            self._idle.append((now, conn))

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), collections.deque()
        for _, conn in idle:
            conn.done()
