"""A TCP proxy on 127.0.0.1 in front of a real server (PostgreSQL, RabbitMQ), to break connections on purpose.

`cut()` aborts every current connection both ways (SO_LINGER 0: the client and the server each get a
RST, as when a network path or a firewall drops a connection); `refuse_for(seconds)` resets new
connections for a while (a server that is down, or unreachable). One thread runs all connections
through a selector. Plain Python (no pytest), so the bench script uses it too.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from functools import partial

_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST instead of a FIN
_CHUNK = 256 * 1024


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
    sock.close()


class _Link:
    """One proxied connection: the client's socket, the server's, and what each still has to receive."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.peer = {client: server, server: client}
        self.pending = {client: bytearray(), server: bytearray()}
        self.writing = {client: False, server: False}
        self.closed = False


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `upstream`; a context manager; `close()` ends everything."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", name: str = "proxy") -> None:
        self.name = name
        self.upstream = (upstream_host, upstream_port)
        self.accepted = 0  # connections forwarded
        self.refused = 0  # connections reset by refuse_for
        self.cut_connections = 0  # connections aborted by cut()
        self._refuse_until = 0.0
        self._links: set[_Link] = set()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._run_calls)
        self._thread = threading.Thread(target=self._loop, name=f"tcp-proxy-{name}-{self.port}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"TcpProxy({self.name}: 127.0.0.1:{self.port} -> {self.upstream[0]}:{self.upstream[1]})"

    # -- faults ------------------------------------------------------------------------------------
    def cut(self) -> int:
        """Abort every current connection, both ways, with a RST; returns how many were cut."""
        return self._call(self._cut_all)

    def refuse_for(self, seconds: float) -> None:
        """Reset every new connection for `seconds` (connections already open are left alone)."""
        self._refuse_until = time.monotonic() + seconds

    def open_connections(self) -> int:
        return self._call(lambda: len(self._links))

    # -- life cycle --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone already
            self._call(self._cut_all)
        self._closed = True
        self._wake()
        self._thread.join(5)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop (every socket is touched only by the proxy's thread) ------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _call(self, fn: Callable[[], int]) -> int:
        if threading.current_thread() is self._thread:
            return fn()
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"{self!r} is closed")
        done, result = threading.Event(), []
        self._calls.put((fn, result, done))
        self._wake()
        if not done.wait(10):
            raise RuntimeError(f"{self!r} did not answer within 10 s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _run_calls(self, sock: socket.socket, _mask: int) -> None:
        try:
            while sock.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, result, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result.append(fn())
            except BaseException as exc:  # handed to the caller
                result.append(exc)
            done.set()

    def _loop(self) -> None:
        while not self._closed:
            for key, mask in self._selector.select(timeout=0.5):
                key.data(key.fileobj, mask)

    def _accept(self, listener: socket.socket, _mask: int) -> None:
        while True:
            try:
                client, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                self.refused += 1
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)  # the server itself refused: pass that on
                continue
            self.accepted += 1
            link = _Link(client, server)
            for sock in (client, server):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._selector.register(sock, selectors.EVENT_READ, partial(self._io, link))
            self._links.add(link)

    def _io(self, link: _Link, sock: socket.socket, mask: int) -> None:
        if link.closed:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(link, sock)
        if link.closed or not mask & selectors.EVENT_READ:
            return
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by one side: reset the other too
            self._abort(link)
            return
        if not data:  # an orderly close by one side: pass on what is left, then close both
            self._finish(link)
            return
        peer = link.peer[sock]
        link.pending[peer] += data
        self._flush(link, peer)

    def _flush(self, link: _Link, sock: socket.socket) -> None:
        buffer = link.pending[sock]
        try:
            while buffer:
                sent = sock.send(buffer)
                del buffer[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._abort(link)
            return
        wanted = bool(buffer)
        if wanted != link.writing[sock]:
            link.writing[sock] = wanted
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wanted else 0)
            self._selector.modify(sock, events, partial(self._io, link))

    def _forget(self, link: _Link) -> list[socket.socket]:
        link.closed = True
        self._links.discard(link)
        sockets = list(link.peer)
        for sock in sockets:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
        return sockets

    def _abort(self, link: _Link) -> None:
        for sock in self._forget(link):
            _reset(sock)

    def _finish(self, link: _Link) -> None:
        for sock in self._forget(link):
            if link.pending[sock]:
                try:
                    sock.settimeout(1.0)
                    sock.sendall(link.pending[sock])
                except OSError:
                    pass
            sock.close()

    def _cut_all(self) -> int:
        links = list(self._links)
        for link in links:
            self._abort(link)
        self.cut_connections += len(links)
        return len(links)
