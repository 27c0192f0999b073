"""The control channel: JSON lines over TCP between the group's members and its leader.

Every member listens (:class:`ControlServer`, port 0, so that whoever becomes the next leader is
reachable) and keeps one connection (:class:`Link`) to the current leader. That connection is the
liveness signal: a process that dies closes it and the other end reads EOF within milliseconds
(measured here); TCP keepalive (idle 2 s, interval 1 s, 3 probes) covers a peer whose host vanished
without a reset. A candidate leader that refuses the connection is dead and the next candidate
is tried (:func:`connect` raises :class:`ConnectionRefusedError`).

A connection starts with a challenge-response in both directions: each side proves it holds the
job's secret by an HMAC-SHA256 over the other side's nonce (the secret never travels). Lines are
read with a size limit and parsed with the depth limit, duplicate keys and NaN refused
(:func:`worker.recovery.records.parse`); a line that breaks them closes the connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.errors import ElastrainError
from worker.recovery.records import MAX_RECORD_BYTES, MemberInfo, RecordError, dump, parse

MAX_LINE = MAX_RECORD_BYTES
HANDSHAKE_TIMEOUT_S = 5.0
Message = dict[str, Any]


class ControlError(ElastrainError):
    """A control connection could not be used (refused handshake, bad line)."""


class AuthError(ControlError):
    """The other end does not hold the job's secret."""


def mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def _nonce() -> str:
    return os.urandom(16).hex()


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"control address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


BYE_MAX_AGE_S = 60.0


def bye_time(msg: Message, now: float) -> float | None:
    """The time a ``bye`` message gives (its sender's node died then: its torchrun agent, seen by
    :mod:`worker.start.lifeline`), or None when it is not a number in ``[now - BYE_MAX_AGE_S, now]`` --
    a later time than its arrival means nothing, a far older one is a broken clock."""
    at = msg.get("at")
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        return None
    return float(at) if now - BYE_MAX_AGE_S <= at <= now else None


class Conn:
    """One authenticated connection. ``send`` is thread-safe; a failed send closes it."""

    def __init__(self, sock: socket.socket, peer: MemberInfo) -> None:
        self.sock, self.peer = sock, peer
        self.reader = sock.makefile("rb")
        self._send_lock = threading.Lock()
        self.closed = threading.Event()

    def send(self, msg: Message) -> bool:
        line = dump(msg) + b"\n"
        try:
            with self._send_lock:
                self.sock.sendall(line)
            return True
        except OSError:
            self.close()
            return False

    def read(self) -> Message | None:
        """The next message; None at EOF or on a line that breaks the limits."""
        line = self.reader.readline(MAX_LINE + 1)
        if not line or not line.endswith(b"\n"):
            return None
        try:
            msg = parse(line, what=f"control line from {self.peer.member_id}", max_bytes=MAX_LINE)
        except RecordError:
            return None
        return msg if isinstance(msg.get("t"), str) else None

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def _line(sock_file: Any, what: str) -> Message:
    line = sock_file.readline(MAX_LINE + 1)
    if not line or not line.endswith(b"\n"):
        raise ControlError(f"{what}: connection closed during the handshake")
    return parse(line, what=what, max_bytes=MAX_LINE)


class ControlServer:
    """Accepts members' connections; calls ``on_hello(conn)`` once authenticated, then
    ``on_message(conn, msg)`` per line and ``on_close(conn, when)`` once at EOF. Callbacks run
    on the connection's own thread."""

    def __init__(
        self,
        secret: bytes,
        *,
        advertise: str,
        on_hello: Callable[[Conn], None],
        on_message: Callable[[Conn, Message], None],
        on_close: Callable[[Conn, float], None],
        bind: str = "0.0.0.0",
    ) -> None:
        self.secret = secret
        self.on_hello, self.on_message, self.on_close = on_hello, on_message, on_close
        self._listener = socket.create_server((bind, 0))
        self._listener.settimeout(0.5)
        self.address = f"{advertise}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[Conn] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="elastrain-control-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock,), name="elastrain-control-conn", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket) -> Conn:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        _keepalive(sock)
        reader = sock.makefile("rb")
        challenge = _nonce()
        sock.sendall(dump({"t": "challenge", "nonce": challenge}) + b"\n")
        hello = _line(reader, "hello")
        raw_info, nonce = hello.get("info"), hello.get("nonce")
        if not isinstance(raw_info, dict) or not isinstance(nonce, str) or hello.get("t") != "hello":
            raise ControlError("hello: not a hello line")
        expected = mac(self.secret, "hello", challenge, nonce, dump(raw_info).decode())
        if not hmac.compare_digest(expected, str(hello.get("mac", ""))):
            raise AuthError("hello: wrong job secret")
        info = MemberInfo.from_json(raw_info, what="hello")
        sock.sendall(dump({"t": "welcome", "mac": mac(self.secret, "welcome", nonce, challenge)}) + b"\n")
        sock.settimeout(None)
        conn = Conn(sock, info)
        conn.reader = reader
        return conn

    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = self._handshake(sock)
        except (OSError, ControlError, RecordError):
            with contextlib.suppress(OSError):
                sock.close()
            return
        with self._lock:
            self._conns.add(conn)
        try:
            self.on_hello(conn)
            while not conn.closed.is_set():
                msg = conn.read()
                if msg is None:
                    break
                self.on_message(conn, msg)
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
            self.on_close(conn, time.time())

    def close(self) -> None:
        """Stop accepting and close every connection. Idempotent."""
        self._stop.set()
        with contextlib.suppress(OSError):  # stops listening at once, even under a blocked accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()


class Link:
    """This member's connection to a leader: messages arrive on a queue, EOF as ``None``.
    ``closed_at``: when the connection ended (either end closed it); :attr:`lost_at`: the
    leader's last sign of life, once known -- the time its ``bye`` gave (its node died then;
    :func:`bye_time`), else its end of the connection closing (not this member's own close).
    ``lost``: the members the leader said it lost, by generation (:meth:`Hub.on_close`)."""

    def __init__(self, conn: Conn, address: str) -> None:
        self.conn, self.address = conn, address
        self.messages: queue.Queue[Message | None] = queue.Queue()
        self.closed_at: float | None = None
        self.bye_at: float | None = None
        self.eof_at: float | None = None
        self.lost: set[tuple[int, str]] = set()  # (generation, member) the leader said it lost
        self.step: int | None = None  # the last step the leader said it completed (its ``at``)
        threading.Thread(target=self._read, name="elastrain-control-link", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.read()
                if msg is None:
                    break
                if msg["t"] == "bye":
                    self.bye_at = bye_time(msg, time.time())
                    continue
                if msg["t"] == "at":  # the leader's beacon, read when it is lost
                    step = msg.get("step")
                    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                        self.step = step
                    continue
                if msg["t"] == "lost":  # read by the save's wait, not by the training thread
                    g, m = msg.get("generation"), msg.get("member")
                    if isinstance(g, int) and isinstance(m, str):
                        self.lost.add((g, m))
                    continue
                self.messages.put(msg)
        except OSError:
            pass
        now = time.time()
        if not self.conn.closed.is_set():  # the other end went, not this member's close()
            self.eof_at = now
        self.closed_at = now
        self.conn.close()
        self.messages.put(None)

    @property
    def lost_at(self) -> float | None:
        known = [t for t in (self.bye_at, self.eof_at) if t is not None]
        return min(known) if known else None

    @property
    def alive(self) -> bool:
        return self.closed_at is None and not self.conn.closed.is_set()

    def lost_in(self, generation: int, members: tuple[str, ...]) -> str | None:
        """The first of ``members`` the leader said it lost in ``generation``, or None (in the
        record's order, as :meth:`Hub.gone` answers on the leader)."""
        told = set(self.lost)  # a copy: the reader thread adds to it
        return next((m for m in members if (generation, m) in told), None)

    def send(self, msg: Message) -> bool:
        return self.conn.send(msg)

    def recv(self, timeout: float | None) -> Message | None:
        """The next message, None once the other end is gone; raises TimeoutError."""
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no control message") from None
        if msg is None:
            self.messages.put(None)  # EOF stays visible to the next reader
        return msg

    def close(self) -> None:
        self.conn.close()


def connect(address: str, secret: bytes, *, me: MemberInfo, timeout_s: float = 1.0) -> Link:
    """Connect to the control server at ``address`` as ``me``. Raises ConnectionRefusedError
    (nobody listens: the candidate is dead), TimeoutError/OSError (unknown), or AuthError."""
    host, port = split_address(address)
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.settimeout(max(timeout_s, HANDSHAKE_TIMEOUT_S))
        _keepalive(sock)
        reader = sock.makefile("rb")
        challenge = _line(reader, "challenge")
        theirs, ours = str(challenge.get("nonce", "")), _nonce()
        info = dump(me)
        hello = {"t": "hello", "info": parse(info, what="hello"), "nonce": ours,
                 "mac": mac(secret, "hello", theirs, ours, info.decode())}  # fmt: skip
        sock.sendall(dump(hello) + b"\n")
        welcome = _line(reader, "welcome")
        if not hmac.compare_digest(mac(secret, "welcome", ours, theirs), str(welcome.get("mac", ""))):
            raise AuthError(f"control server {address} does not hold the job's secret")
        sock.settimeout(None)
    except RecordError as exc:
        sock.close()
        raise ControlError(f"control server {address}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    conn = Conn(sock, MemberInfo("leader", "member", address))
    conn.reader = reader
    return Link(conn, address)
