"""A TCP proxy in front of the S3 server that injects faults per request.

Each client connection carries one request: the proxy reads the request head,
decides a fault, and either answers itself, forwards the request with
``Connection: close`` and pipes the answer back, cuts the connection
halfway through the answer with a TCP reset, or ends it there cleanly (FIN:
a body shorter than its Content-Length, a short read).

Latency mode (``rtt_ms`` > 0) is the other use: a plain byte pipe that keeps
the client's connections alive (as real S3 does) and delays every chunk by
half a round trip in each direction, plus one round trip before a new
connection's first byte (the TCP handshake). ``tc netem`` is not available on
these kernels, so this is how the benchmark puts ~20 ms between the client and
a loopback S3 server. Bandwidth is not limited; the proxy's own CPU runs in
the benchmark process, not in the measured tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
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
Policy = Callable[[int, str], str]  # returns "pass", "slowdown", "reset", "short" or "deny"


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
    #: Latency mode: the round trip added between client and upstream (policy unused).
    rtt_ms: float = 0.0
    #: The loop thread's kernel id, once started: its CPU is in /proc/self/task/<id>/stat
    #: (the stager bench bills the proxy's share of the shared cores with it).
    thread_id: int = 0
    #: Forwarded requests are held this long before going upstream, so that a
    #: client's requests in flight pile up where ``peak_in_flight`` sees them.
    hold_s: float = 0.0
    #: Only requests whose line this regex matches are held ("": all of them).
    hold_match: str = ""
    #: hold_match is searched in the whole request head (its line and headers), not the line only
    #: (a ranged part is told from the others by its Range header).
    hold_head: bool = False
    #: Requests arrived and not yet forwarded upstream, now and at most (counted
    #: while held, before any answer byte: a client that waits for one answer before
    #: sending another request is never counted twice, however fast it turns around).
    in_flight: int = 0
    peak_in_flight: int = 0
    _n: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            self.thread_id = threading.get_native_id()
            self._serving = asyncio.current_task()
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
        async def shutdown() -> None:
            # Connections still open (keep-alive in latency mode) end first, so
            # no task is left pending when the loop stops; then the server.
            conns = [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), self._serving)]
            for task in conns:
                task.cancel()
            await asyncio.gather(*conns, return_exceptions=True)
            self._server.close()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.rtt_ms > 0:
            await self._delayed(reader, writer)
            return
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
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    where = head.decode("latin-1") if self.hold_head else line
                    if self.hold_s and (not self.hold_match or re.search(self.hold_match, where)):
                        await asyncio.sleep(self.hold_s)
                finally:
                    self.in_flight -= 1
                await self._forward(head, reader, writer, cut=action == "reset", short=action == "short")
                return
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def _forward(self, head: bytes, reader, writer, cut: bool, short: bool = False) -> None:
        up_r, up_w = await asyncio.open_connection(*self.upstream)
        lines = [ln for ln in head.split(b"\r\n") if ln and not ln.lower().startswith(b"connection:")]
        up_w.write(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n")
        # Request bodies (PUTs while seeding) follow the head.
        length = next((int(ln.split(b":", 1)[1]) for ln in lines if ln.lower().startswith(b"content-length:")), 0)
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
                if short and sent > 0:
                    break  # a clean close after the first chunk: fewer bytes than the head announced
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            up_w.close()
        writer.close()

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pipe one keep-alive connection both ways, each chunk held back by half the round trip."""
        half = self.rtt_ms / 2000
        await asyncio.sleep(2 * half)  # the handshake's round trip
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.counts["connections"] = self.counts.get("connections", 0) + 1
        try:
            await asyncio.gather(_delayed_pipe(reader, up_w, half), _delayed_pipe(up_r, writer, half))
        finally:
            up_w.close()
            writer.close()


async def _delayed_pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
    """Copy src to dst, each chunk delivered ``delay`` seconds after it arrived, in order.

    One queue and one sender per direction keep the order (timers with equal
    deadlines would not) and let reading run ahead of the delayed writes, as a
    long link holds bytes in flight.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, chunk = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not chunk:
                break
            dst.write(chunk)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()

    sender = asyncio.create_task(send())
    try:
        while True:
            try:
                chunk = await src.read(1 << 16)
            except ConnectionError:
                chunk = b""
            queue.put_nowait((loop.time() + delay, chunk))
            if not chunk:
                break
        await sender
    except (ConnectionError, OSError):
        pass
    finally:
        # Awaited, not only cancelled: at stop() the loop ends right after, and a
        # sender still cancelling then is reported as "Task was destroyed but it is pending".
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
            await sender
