"""The gthread worker that reads each request whole before a thread takes it (engine/buffered_worker.py):
when a request is whole, and, under a real gunicorn with two threads, that slow clients hold no thread,
that requests read in pieces, pipelined or after 100-continue reach the application intact, and that a
request not whole by its deadline gets a 408."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from engine.buffered_worker import MAX_BUFFERED_BODY_BYTES, MAX_HEAD_BYTES, SettledConfig, request_complete
from scripts.local_processes import free_port

ROOT = Path(__file__).resolve().parent.parent
READ_TIMEOUT_S = 1.5


def echo_app(environ, start_response):
    """The application the worker serves in these tests: the request's body back, with its method."""
    body = environ["wsgi.input"].read()
    out = environ["REQUEST_METHOD"].encode() + b" " + body
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(out)))])
    return [out]


POST = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n4;ext=1\r\n you\r\n0\r\n\r\n"


def test_a_worker_reads_each_setting_once_and_keeps_it():
    from gunicorn.config import Config
    cfg = Config()
    settled = SettledConfig(cfg)
    assert settled.keepalive == cfg.keepalive == 2
    assert settled.forwarded_allow_networks() == cfg.forwarded_allow_networks()
    cfg.set("keepalive", 9)            # what a master's reload does: its workers keep what they started with
    assert settled.keepalive == 2 and cfg.keepalive == 9
    with pytest.raises(AttributeError):
        settled.no_such_setting


@pytest.mark.parametrize("request_bytes", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", POST, CHUNKED,
                                           CHUNKED[:-2] + b"X-Trailer: 1\r\n\r\n"])
def test_a_request_is_whole_only_at_its_last_byte(request_bytes):
    for cut in range(len(request_bytes)):
        assert request_complete(request_bytes[:cut]) == (False, False), request_bytes[:cut]
    assert request_complete(request_bytes) == (True, False)


@pytest.mark.parametrize("request_bytes", [
    b"POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",                             # the parser answers these
    b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 9\r\n\r\n",
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BUFFERED_BODY_BYTES + 1),   # the app's 413
    b"GET /" + b"a" * MAX_HEAD_BYTES,
])
def test_what_is_malformed_or_too_large_goes_to_a_thread_as_it_is(request_bytes):
    assert request_complete(request_bytes)[0]


def test_a_head_that_expects_100_continue_says_so():
    head = b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n"
    assert request_complete(head) == (False, True) and request_complete(head + b"abc") == (True, True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    conf = tmp_path_factory.mktemp("buffered-worker") / "gunicorn.conf.py"
    conf.write_text("import engine.buffered_worker as w\n"
                    f"w.REQUEST_READ_TIMEOUT_S = {READ_TIMEOUT_S}\n"
                    "worker_class = 'engine.buffered_worker.BufferedThreadWorker'\n"
                    f"bind = '127.0.0.1:{port}'\nworkers = 1\nthreads = 2\nkeepalive = 5\n")
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", str(conf), "tests.test_buffered_worker:echo_app"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            requests.get(url, timeout=1)
            break
        except requests.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
    yield port
    proc.terminate()
    proc.wait(10)


def _connect(port) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _read_responses(s: socket.socket, count: int) -> bytes:
    """Bytes until `count` final responses (Content-Length bodies) have been read."""
    data = b""
    while True:
        finals, p = 0, 0
        while (end := data.find(b"\r\n\r\n", p)) >= 0:
            head = data[p:end]
            if head.startswith(b"HTTP/1.1 100"):
                p = end + 4
                continue
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head.lower() else 0
            if len(data) < end + 4 + length:
                break
            finals, p = finals + 1, end + 4 + length
        if finals >= count:
            return data
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_slow_clients_hold_no_thread(server):
    slow = [_connect(server) for _ in range(8)]   # four times the threads
    for s in slow:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
    try:
        for _ in range(3):
            time.sleep(0.3)
            for s in slow:
                s.sendall(b"X")   # a byte at a time, never ending the head
            started = time.monotonic()
            r = requests.post(f"http://127.0.0.1:{server}/echo", data=b"hi", timeout=5)
            assert r.text == "POST hi" and time.monotonic() - started < 1.0
    finally:
        for s in slow:
            s.close()


@pytest.mark.parametrize("request_bytes", [POST, CHUNKED])
def test_a_request_sent_in_pieces_reaches_the_app_whole(server, request_bytes):
    with _connect(server) as s:
        for i in range(0, len(request_bytes), 7):
            s.sendall(request_bytes[i:i + 7])
            time.sleep(0.02)
        out = _read_responses(s, 1)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"POST hello" + (b" you" if request_bytes is CHUNKED else b""))


def test_pipelined_requests_on_a_kept_alive_connection_are_all_answered(server):
    with _connect(server) as s:
        s.sendall(POST + CHUNKED + b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        out = _read_responses(s, 3)
    assert out.count(b"HTTP/1.1 200") == 3
    assert b"POST hello" in out and b"POST hello you" in out and out.endswith(b"GET ")


def test_a_body_sent_after_100_continue_reaches_the_app(server):
    with _connect(server) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"body")
        out = _read_responses(s, 1)
    assert out.endswith(b"POST body")


def test_a_request_not_whole_by_its_deadline_gets_a_408_and_the_connection_closes(server):
    with _connect(server) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        started = time.monotonic()
        out = _read_responses(s, 1)
        waited = time.monotonic() - started
        assert s.recv(1) == b""   # closed
    assert out.startswith(b"HTTP/1.1 408") and READ_TIMEOUT_S - 0.2 < waited < READ_TIMEOUT_S + 2.5
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"NOT A REQUEST\r\n\r\n", 400, "bad_request"),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),   # past limit_request_line
])
def test_what_gunicorn_cannot_read_is_answered_in_openais_error_shape(server, request_bytes, status, code):
    with _connect(server) as s:
        s.sendall(request_bytes)
        out = _read_responses(s, 1)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status) and b"Content-Type: application/json" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["message"]
