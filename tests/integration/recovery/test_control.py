"""The control channel on real sockets: authenticated both ways by the job secret, EOF seen as a
death on either end, a refused connection for a process that is gone, lines read with limits."""

from __future__ import annotations

import queue
import socket
import time
from typing import Any

import pytest

from worker.recovery.control import MAX_LINE, ControlError, ControlServer, connect, split_address
from worker.recovery.records import MemberInfo

pytestmark = pytest.mark.integration
SECRET = b"s" * 32


class Recorder:
    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()

    def hello(self, conn: Any) -> None:
        self.events.put(("hello", conn))

    def message(self, conn: Any, msg: dict[str, Any]) -> None:
        self.events.put(("message", msg))
        conn.send({"t": "echo", "got": msg["t"]})

    def close(self, conn: Any, when: float) -> None:
        self.events.put(("close", (conn.peer.member_id, when)))

    def next(self) -> tuple[str, Any]:
        return self.events.get(timeout=10)


def server(recorder: Recorder, secret: bytes = SECRET) -> ControlServer:
    return ControlServer(secret, advertise="127.0.0.1", bind="127.0.0.1", on_hello=recorder.hello,
                         on_message=recorder.message, on_close=recorder.close)  # fmt: skip


ME = MemberInfo("m1", "spare", "127.0.0.1:1", node_index=2)


def test_messages_both_ways_and_eof_on_either_end() -> None:
    recorder = Recorder()
    srv = server(recorder)
    try:
        link = connect(srv.address, SECRET, me=ME)
        kind, conn = recorder.next()
        assert kind == "hello" and conn.peer == ME
        sock = link.conn.sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        link.send({"t": "ping"})
        assert recorder.next() == ("message", {"t": "ping"})
        assert link.recv(10) == {"t": "echo", "got": "ping"}
        before = time.time()
        link.close()  # the member dies: the server reads EOF, timed
        kind, (member, when) = recorder.next()
        assert kind == "close" and member == "m1" and when >= before
        link2 = connect(srv.address, SECRET, me=ME)
        assert recorder.next()[0] == "hello"
        srv.close()  # the leader dies: the member reads EOF
        assert link2.recv(10) is None and not link2.alive
    finally:
        srv.close()


def test_a_wrong_secret_is_refused_both_ways() -> None:
    recorder = Recorder()
    srv = server(recorder)
    try:
        with pytest.raises(ControlError):
            connect(srv.address, b"x" * 32, me=ME)
        assert recorder.events.empty(), "no hello reached the server"
    finally:
        srv.close()
    impostor = server(Recorder(), secret=b"y" * 32)  # a server without the job's secret
    try:
        with pytest.raises(ControlError):
            connect(impostor.address, SECRET, me=ME)
    finally:
        impostor.close()


def test_a_gone_process_refuses_the_connection() -> None:
    srv = server(Recorder())
    address = srv.address
    srv.close()
    with pytest.raises(ConnectionRefusedError):
        connect(address, SECRET, me=ME)


def test_an_oversize_line_closes_the_connection() -> None:
    recorder = Recorder()
    srv = server(recorder)
    try:
        link = connect(srv.address, SECRET, me=ME)
        assert recorder.next()[0] == "hello"
        link.conn.sock.sendall(b'{"t": "x", "pad": "' + b"a" * MAX_LINE + b'"}\n')
        kind, (member, _) = recorder.next()
        assert (kind, member) == ("close", "m1")
        assert link.recv(10) is None
    finally:
        srv.close()


def test_addresses() -> None:
    assert split_address("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("nohost")
