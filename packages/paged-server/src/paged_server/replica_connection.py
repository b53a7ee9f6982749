"""A connection to an engine replica whose answer must arrive by a deadline (the data-parallel
front's, data_parallel.py). The socket timeout alone bounds one receive, so a replica sending a
byte now and then would hold its reader forever: here every receive counts against a deadline
(`ReplicaConnection.expect`), and, while the front waits, whether its own client is still
there is asked every WATCH_INTERVAL (`watch`), so an abandoned request ends on the replica too.
"""

from __future__ import annotations

import http.client
import io
import math
import socket
import time
from collections.abc import Callable
from typing import Any

WATCH_INTERVAL = 0.25  # seconds between checks that a waiting client is still there (app.py's)


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
                return self._sock.recv_into(buf)
            self._sock.settimeout(min(left, WATCH_INTERVAL))
            try:
                return self._sock.recv_into(buf)
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

    def watch(self, client_gone: Callable[[], bool]) -> None:
        """Reads waiting on the replica end (`ClientGone`) once `client_gone()` is True."""
        assert self.reads is not None, "connect first"
        self.reads.client_gone = client_gone
