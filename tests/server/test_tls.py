"""HTTPS: vLLM's --ssl-* flags over the real server code (fake engine) and the real engine.

The certificates under tls/ are self-signed test fixtures (EC P-256, valid to 2126):
`openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 36500
-subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1` (server), and the same
with `-subj /CN=paged-test-client` and no SAN (client).
"""

from __future__ import annotations

import json
import select
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import COMMON_ARGS, REAL_ARGS, ServerProc, launch

from paged_server.cli_args import parse_args
from paged_server.data_parallel import replica_argv
from paged_server.tls import TLS, TLSConfig

CERTS = Path(__file__).parent / "tls"
SERVER_KEY, SERVER_CRT = str(CERTS / "server.key"), str(CERTS / "server.crt")
CLIENT_KEY, CLIENT_CRT = str(CERTS / "client.key"), str(CERTS / "client.crt")
HTTPS_ARGS = ["--ssl-keyfile", SERVER_KEY, "--ssl-certfile", SERVER_CRT]


def trusting(client_cert: bool = False) -> ssl.SSLContext:
    """A client context that trusts the test server's certificate (and presents ours)."""
    ctx = ssl.create_default_context(cafile=SERVER_CRT)
    if client_cert:
        ctx.load_cert_chain(CLIENT_CRT, CLIENT_KEY)
    return ctx


def start(args: list[str], fake: bool = True, client_cert: bool = False) -> ServerProc:
    server = launch([*args, *HTTPS_ARGS], fake=fake)
    server.ssl_context = trusting(client_cert)
    return server


@pytest.fixture(scope="module")
def https_server() -> Iterator[ServerProc]:
    # short timeouts: the slow-handshake test waits them out
    args = [*COMMON_ARGS, "--client-timeout", "1", "--timeout-keep-alive", "1"]
    server = start(args)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


def test_https_answers_json_streams_and_the_openai_client(https_server: ServerProc) -> None:
    import openai

    assert https_server.url.startswith("https://127.0.0.1:")
    status, _, body = https_server.request("GET", "/health")
    assert status == 200, body
    body = {"prompt": "hello", "max_tokens": 5}
    status, _, out = https_server.request("POST", "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 5, out
    events = https_server.stream(body)
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events if e["choices"]) >= 1
    with openai.DefaultHttpxClient(verify=trusting()) as http_client:
        client = openai.OpenAI(
            base_url=https_server.url + "/v1",
            api_key="EMPTY",
            http_client=http_client,
            max_retries=0,
        )
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage.completion_tokens == 4
        streamed = client.completions.create(model="tiny", prompt="x", max_tokens=3, stream=True)
        assert sum(1 for c in streamed if c.choices and c.choices[0].text) >= 1


def test_plain_http_and_untrusting_clients_fail_alone(https_server: ServerProc) -> None:
    """A plain-HTTP request to the HTTPS port and a client that does not trust the certificate
    fail their handshake; the server goes on serving."""
    with socket.create_connection((https_server.host, https_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            got = s.recv(4096)
        except ConnectionResetError:
            got = b""
        assert not got.startswith(b"HTTP/1.1 200"), got
    with pytest.raises(ssl.SSLCertVerificationError):
        ServerProc(None, https_server.url, ssl_context=ssl.create_default_context()).request(
            "GET", "/health"
        )
    status, _, _ = https_server.request("GET", "/health")
    assert status == 200


def tls_socket(server: ServerProc) -> ssl.SSLSocket:
    raw = socket.create_connection((server.host, server.port), timeout=10)
    return trusting().wrap_socket(raw, server_hostname="127.0.0.1")


def post(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )


def test_trickled_handshakes_and_headers_are_closed(https_server: ServerProc) -> None:
    """A client that trickles its handshake, or its request headers over TLS, a byte at a time
    (each byte well inside the socket timeout) holds a thread only until the deadline
    (keep-alive 1 s + client timeout 1 s here)."""
    for handshake in (True, False):
        if handshake:
            s = socket.create_connection((https_server.host, https_server.port), timeout=10)
            s.sendall(b"\x16\x03\x01\x02\x00")  # a ClientHello record header: 512 bytes follow
            trickle = b"\x00" * 400
        else:
            s = tls_socket(https_server)
            trickle = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: y\r\n" * 40
        t0 = time.monotonic()
        closed = False
        with s:
            for i in range(len(trickle)):
                try:
                    s.sendall(trickle[i : i + 1])
                    ready, _, _ = select.select([s], [], [], 0.25)
                    closed = bool(ready) and s.recv(4096) == b""
                except (OSError, ssl.SSLError):
                    closed = True
                if closed or time.monotonic() - t0 > 10:
                    break
        waited = time.monotonic() - t0
        assert closed and waited < 6, (handshake, waited)


def test_a_client_gone_mid_request_is_aborted(https_server: ServerProc) -> None:
    """TLS cannot peek at the socket: the disconnect probe reads records instead. A client that
    closes while waiting for a JSON answer, or drops a stream, is aborted, with no error."""
    before = https_server.metrics().get("paged:request_aborted_total", 0)
    for stream in (False, True):
        s = tls_socket(https_server)
        body = {"prompt": "long:", "max_tokens": 100, "ignore_eos": True, "stream": stream}
        s.sendall(post(body))
        if stream:
            assert s.recv(4096)  # headers or the first event: the request runs
        else:
            time.sleep(0.3)
        s.close()
    m = https_server.wait_idle()
    assert m["paged:num_requests_running"] == 0
    assert m["paged:request_aborted_total"] >= before + 2
    assert not any("unhandled error" in line for line in https_server.lines), https_server.lines


def test_a_pipelined_request_does_not_fail_the_one_running(https_server: ServerProc) -> None:
    """Bytes that arrive while a request waits for its answer are not a disconnect: the running
    request is answered in full, then the connection closes (the bytes cannot be put back)."""
    with tls_socket(https_server) as s:
        body = {"prompt": "x", "max_tokens": 20, "ignore_eos": True}
        s.sendall(post(body))
        time.sleep(0.1)
        s.sendall(post(body))
        reply = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    assert b"Connection: close" in head
    assert json.loads(payload)["usage"]["completion_tokens"] == 20


def test_client_certificates_required() -> None:
    """--ssl-cert-reqs 2 with --ssl-ca-certs: only a client presenting a certificate that CA
    file vouches for gets through the handshake."""
    server = start([*COMMON_ARGS, "--ssl-ca-certs", CLIENT_CRT, "--ssl-cert-reqs", "2"])
    try:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            server.request("GET", "/health")
        server.ssl_context = trusting(client_cert=True)
        status, _, _ = server.request("GET", "/health")
        assert status == 200
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def test_real_engine_over_https(tiny_model: str) -> None:
    server = start(["--model", tiny_model, *REAL_ARGS], fake=False)
    try:
        status, _, out = server.request(
            "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        )
        assert status == 200 and out["usage"]["completion_tokens"] == 4, out
        assert any("serving on https://127.0.0.1:" in line for line in server.lines)
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--ssl-keyfile", SERVER_KEY], "needs both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "need --ssl-keyfile and --ssl-certfile"),
        ([*HTTPS_ARGS, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0, 1 or 2"),
    ],
)
def test_flag_errors_name_the_flag(extra: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", "m", *extra])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--ssl-keyfile", SERVER_KEY, "--ssl-certfile", "/nonexistent.pem"], "--ssl-certfile"),
        ([*HTTPS_ARGS, "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        ([*HTTPS_ARGS, "--ssl-ciphers", "NO-SUCH-CIPHER"], "--ssl-ciphers"),
        (["--ssl-keyfile", CLIENT_KEY, "--ssl-certfile", SERVER_CRT], "--ssl-keyfile"),
    ],
)
def test_unusable_certificates_fail_before_the_model_loads(extra: list[str], says: str) -> None:
    """The context is built when the port is bound: a bad file exits 2 naming the flag, before
    the (here nonexistent) model would load."""
    cmd = [sys.executable, "-m", "paged_server", "--model", "/nonexistent-model", "--port", "0"]
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "cannot serve HTTPS" in proc.stderr and says in proc.stderr, proc.stderr
    assert "cannot start the engine" not in proc.stderr


def test_refresh_swaps_the_certificate_and_keeps_it_through_a_bad_write(tmp_path: Path) -> None:
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    shutil.copy(SERVER_KEY, key)
    shutil.copy(SERVER_CRT, crt)
    tls = TLS(TLSConfig(str(key), str(crt)), refresh=True, poll_s=0.02)
    try:
        first = tls.context
        crt.write_text("not a certificate")  # a renewal caught half-written
        time.sleep(0.2)
        assert tls.context is first
        shutil.copy(CLIENT_KEY, key)  # the renewed pair
        shutil.copy(CLIENT_CRT, crt)
        deadline = time.monotonic() + 5
        while tls.context is first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tls.context is not first
    finally:
        tls.close()


def test_replicas_get_plain_http() -> None:
    argv = ["m", "-dp", "2", *HTTPS_ARGS, "--ssl-cert-reqs=0", "--enable-ssl-refresh", "-tp", "2"]
    assert replica_argv(argv) == ["m", "-tp", "2"]
