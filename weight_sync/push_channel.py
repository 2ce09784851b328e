"""A fast control channel for registered IPC pushes into single-rank replicas (issue #7).

A Ray actor call costs about a millisecond, close to the whole copy a registered push does on
a GPU. Once a layout is registered (through Ray), a push only needs to say "layout X, version
V, go": `PushChannelServer` (in the shard) listens on 127.0.0.1 only, on a port the OS picks,
and serves that message on a daemon thread; `PushChannelClient` (in the trainer's controller)
sends it. The shard runs exactly what its Ray `update_weights("ipc", IpcLayoutRef(...))` runs.

Protocol: every message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (never
pickle), at most `MAX_MESSAGE` bytes. A connection's first message is the secret token
(`secrets.token_hex`, handed out through Ray); a wrong one is answered with an `AuthError` and
the connection is closed, before any request is read. Then requests, each answered in order:
`{"op": "push", "layout_id", "version", "allow_partial", "pause_mode"}` →
`{"ok": true, "version", "incomplete"}` or `{"ok": false, "error_type", "message"}`;
`{"op": "precheck", "layout_id", "allow_partial"}` → `{"ok": true}` or the error a push would
raise before writing (a layout the shard does not hold: asked of every shard before any loads);
`{"op": "ping"}` → `{"ok": true}` (the channel's own round trip). Every failure to reach the
shard surfaces as `PushChannelError`; the caller then takes the Ray path for that push."""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MAX_MESSAGE = 64 << 10
MAX_CONNECTIONS = 4  # the controller holds one; the rest is slack for a reconnecting trainer
AUTH_TIMEOUT_S = 10.0
_LEN = struct.Struct(">I")


class PushChannelError(ConnectionError):
    """The channel could not deliver a request or its reply (refused, closed, timed out, bad
    token, malformed): nothing can be said about the shard; use the Ray path."""


@dataclass(frozen=True)
class PushChannelInfo:
    """Where a shard's channel listens and the token it wants first."""

    host: str
    port: int
    token: str


# ---- framing -----------------------------------------------------------------------------------
def send_message(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"channel message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket, deadline: Optional[float] = None) -> Optional[dict]:
    """The next message, or None at a clean end of stream. `deadline` (time.monotonic()): the
    whole message by then, however slowly its bytes come (socket.timeout past it)."""
    head = _recv_exact(sock, _LEN.size, eof_ok=True, deadline=deadline)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_MESSAGE:
        raise ValueError(f"channel message of {size} bytes exceeds {MAX_MESSAGE}")
    obj = json.loads(_recv_exact(sock, size, eof_ok=False, deadline=deadline).decode())
    if not isinstance(obj, dict):
        raise ValueError("channel message is not a JSON object")
    return obj


def _recv_exact(sock: socket.socket, n: int, eof_ok: bool,
                deadline: Optional[float] = None) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("channel message not received in time")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if eof_ok and not buf:
                return None
            raise ConnectionError("channel closed mid-message")
        buf += chunk
    return bytes(buf)


# ---- shard side --------------------------------------------------------------------------------
PushHandler = Callable[[str, int, bool, Optional[str]], dict]
PrecheckHandler = Callable[[str, bool], None]


class PushChannelServer:
    """Listens on 127.0.0.1:0 and serves authenticated connections, one thread each (at most
    `MAX_CONNECTIONS`); `handler(layout_id, version, allow_partial, pause_mode)` returns the
    reply's fields, `precheck(layout_id, allow_partial)` raises what a push would before its
    first write, and any exception either raises is answered as {error_type, message}."""

    def __init__(self, handler: PushHandler, precheck: Optional[PrecheckHandler] = None,
                 host: str = LOOPBACK):
        self._handler, self._precheck = handler, precheck
        self.token = secrets.token_hex(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(MAX_CONNECTIONS)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="push-channel", daemon=True)
        self._thread.start()

    @property
    def info(self) -> PushChannelInfo:
        return PushChannelInfo(self.host, self.port, self.token)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="push-channel-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the token within AUTH_TIMEOUT_S in all (a peer trickling bytes holds no slot)
            hello = recv_message(conn, deadline=time.monotonic() + AUTH_TIMEOUT_S)
            token = hello.get("token") if hello else None
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
                send_message(conn, {"ok": False, "error_type": "AuthError", "message": "bad token"})
                return
            send_message(conn, {"ok": True})
            conn.settimeout(None)  # a push may take as long as its copy does
            while not self._closed:
                request = recv_message(conn)
                if request is None:
                    return
                send_message(conn, self._answer(request))
        except (OSError, ValueError) as e:  # a peer that went away or spoke nonsense
            logger.debug("push channel connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, request: dict) -> dict:
        op = request.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "precheck" and self._precheck is not None:
            layout_id, allow_partial = request.get("layout_id"), request.get("allow_partial", False)
            if not isinstance(layout_id, str) or len(layout_id) > 128 or not isinstance(allow_partial, bool):
                return {"ok": False, "error_type": "ValueError", "message": "malformed precheck request"}
            return self._typed(lambda: self._precheck(layout_id, allow_partial) or {})
        if op != "push":
            return {"ok": False, "error_type": "ValueError", "message": f"unknown op {op!r}"}
        layout_id, version = request.get("layout_id"), request.get("version")
        allow_partial, pause_mode = request.get("allow_partial", False), request.get("pause_mode")
        if (not isinstance(layout_id, str) or len(layout_id) > 128 or isinstance(version, bool)
                or not isinstance(version, int) or not isinstance(allow_partial, bool)
                or not (pause_mode is None or isinstance(pause_mode, str))):
            return {"ok": False, "error_type": "ValueError", "message": "malformed push request"}
        return self._typed(lambda: self._handler(layout_id, version, allow_partial, pause_mode))

    @staticmethod
    def _typed(fn: Callable[[], dict]) -> dict:
        try:
            return {"ok": True, **fn()}
        except Exception as e:  # noqa: BLE001 — typed back to the caller, who re-raises it
            return {"ok": False, "error_type": type(e).__name__, "message": str(e)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = list(self._conns), set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---- trainer side ------------------------------------------------------------------------------
class PushChannelClient:
    """One authenticated connection to a shard's channel. Not thread-safe: the controller uses
    it under its weights lock. `send` then `receive` (so several shards work at once)."""

    def __init__(self, info: PushChannelInfo, timeout_s: float = 600.0):
        self.info = info
        try:
            self._sock = socket.create_connection((info.host, info.port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_message(self._sock, {"token": info.token})
            reply = recv_message(self._sock)
        except (OSError, ValueError) as e:
            raise PushChannelError(f"push channel {info.host}:{info.port}: {e}") from e
        if not reply or not reply.get("ok"):
            self.close()
            raise PushChannelError(f"push channel {info.host}:{info.port} refused the connection: "
                                   f"{(reply or {}).get('message', 'closed')}")

    def send(self, request: dict) -> None:
        try:
            send_message(self._sock, request)
        except OSError as e:
            raise PushChannelError(f"push channel send failed: {e}") from e

    def receive(self) -> dict:
        try:
            reply = recv_message(self._sock)
        except (OSError, ValueError) as e:
            raise PushChannelError(f"push channel reply failed: {e}") from e
        if reply is None:
            raise PushChannelError("push channel closed before replying (the shard died?)")
        return reply

    def call(self, request: dict) -> dict:
        self.send(request)
        return self.receive()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def push_request(layout_id: str, version: int, allow_partial: bool, pause_mode: Optional[str]) -> dict:
    return {"op": "push", "layout_id": layout_id, "version": int(version),
            "allow_partial": bool(allow_partial), "pause_mode": pause_mode}


def precheck_request(layout_id: str, allow_partial: bool) -> dict:
    return {"op": "precheck", "layout_id": layout_id, "allow_partial": bool(allow_partial)}


def send_all(clients: list[PushChannelClient], request: dict) -> list[Any]:
    """`request` to every client, then every reply: a reply dict or the `PushChannelError`."""
    sent: list[Any] = []
    for client in clients:
        try:
            client.send(request)
            sent.append(None)
        except PushChannelError as e:
            sent.append(e)
    out = []
    for client, err in zip(clients, sent):
        if err is not None:
            out.append(err)
            continue
        try:
            out.append(client.receive())
        except PushChannelError as e:
            out.append(e)
    return out
