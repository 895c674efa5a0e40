"""A TCP proxy in front of the S3 server that injects faults per request.

Each client connection carries one request: the proxy reads the request head,
decides a fault, and either answers itself, forwards the request with
``Connection: close`` and pipes the answer back, or cuts the connection
halfway through the answer with a TCP reset.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
)
SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
ACCESS_DENIED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>The AWS Access Key Id you provided has been revoked.</Message></Error>"
)
ACCESS_DENIED = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
)

# Decides what happens to the n-th request (0-based) with this request line.
Policy = Callable[[int, str], str]  # returns "pass", "slowdown", "reset" or "deny"


def random_faults(slowdown: float, reset: float, seed: int = 0) -> Policy:
    rng = random.Random(seed)

    def policy(n: int, line: str) -> str:
        x = rng.random()
        if x < slowdown:
            return "slowdown"
        if x < slowdown + reset:
            return "reset"
        return "pass"

    return policy


def deny_after(n_ok: int) -> Policy:
    return lambda n, line: "pass" if n < n_ok else "deny"


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    policy: Policy
    host: str = "127.0.0.1"
    port: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    _n: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            try:
                async with self._server:
                    await self._server.serve_forever()
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(serve(),), daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        n, self._n = self._n, self._n + 1
        action = self.policy(n, line)
        self.counts[action] = self.counts.get(action, 0) + 1
        try:
            if action == "slowdown":
                writer.write(SLOW_DOWN % (len(SLOW_DOWN_BODY), SLOW_DOWN_BODY))
            elif action == "deny":
                writer.write(ACCESS_DENIED % (len(ACCESS_DENIED_BODY), ACCESS_DENIED_BODY))
            else:
                await self._forward(head, reader, writer, cut=action == "reset")
                return
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def _forward(self, head: bytes, reader, writer, cut: bool) -> None:
        up_r, up_w = await asyncio.open_connection(*self.upstream)
        lines = [l for l in head.split(b"\r\n") if l and not l.lower().startswith(b"connection:")]
        up_w.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n")
        # Request bodies (PUTs while seeding) follow the head.
        length = next((int(l.split(b":", 1)[1]) for l in lines if l.lower().startswith(b"content-length:")), 0)
        if length:
            up_w.write(await reader.readexactly(length))
        await up_w.drain()
        sent = 0
        try:
            while chunk := await up_r.read(65536):
                if cut and sent > 0:
                    # RST instead of FIN: the client sees a dropped connection.
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            up_w.close()
        writer.close()
