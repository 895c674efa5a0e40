"""The agent's HTTP API on the host network (contract: dscache_contract.node).

GET  /healthz       200 while the disk was read lately
GET  /metrics       Prometheus
POST /v1/reserve    the stager: room for a copy (no token; see SECURITY.md)
POST /v1/wipe       the controller: release leases, remove a revision (token required)
POST /v1/peers      the stager: who else stages or holds its revision (no token: it must hold C's lock)
GET  /v1/objects/<namespace>/<cache>/<revision>/<path>?wait=<s>
                    a peer's stager: one complete object, with the cache's peer token
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dscache_contract import RESERVE_PATH, WIPE_PATH, ArgsError, ReserveRequest, WipeRequest
from dscache_contract.peers import (
    OBJECTS_PATH,
    PEERS_PATH,
    REVISION_HEADER,
    ObjectRequest,
    PeersRequest,
    check_peer_token,
)
from dscache_stager.errors import BusyError, UsageError

from .agent import Agent, _locked
from .kube import ApiError
from .peers import Claims, NotHere, check_request, wait_for_object

log = logging.getLogger("dscache-node")
MAX_BODY = 1 << 20


def make_server(agent: Agent, token: Callable[[], str | None], port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    """``token()``: the token wipes must carry, read afresh per request (a rotated Secret
    takes effect without a restart); also the key of every cache's peer token."""

    claims = Claims()

    class Handler(BaseHTTPRequestHandler):
        # Keep-alive: a peer fetches many objects over one connection.
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format % args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                stale = time.monotonic() - agent.last_refresh > max(60.0, 6 * agent.s.scan_interval)
                self._send(503 if stale else 200, b"stale\n" if stale else b"ok\n", "text/plain")
            elif self.path == "/metrics":
                self._send(200, generate_latest(agent.metrics.registry), CONTENT_TYPE_LATEST)
            elif self.path.startswith(OBJECTS_PATH):
                self._object()
            else:
                self._error(404, f"no such path {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                return self._error(413, "request too large")
            text = self.rfile.read(length).decode(errors="replace")
            try:
                if self.path == RESERVE_PATH:
                    self._send(200, agent.reserve(ReserveRequest.from_json(text)).to_json().encode())
                elif self.path == PEERS_PATH:
                    answer = agent.peers(PeersRequest.from_json(text))
                    if answer is None:
                        return self._error(409, "no stager holds this cache's lock on this node: no copy to share")
                    self._send(200, answer.to_json().encode())
                elif self.path == WIPE_PATH:
                    given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
                    wanted = token()
                    if not wanted or not hmac.compare_digest(given.encode(), wanted.encode()):
                        return self._error(401, "a wipe needs the agent token (Authorization: Bearer ...)")
                    summary = agent.wipe(WipeRequest.from_json(text))
                    self._send(200, summary.to_json().encode())
                else:
                    self._error(404, f"no such path {self.path}")
            except BusyError as e:
                self._error(409, str(e))
            except (ArgsError, UsageError, ValueError, KeyError, TypeError) as e:
                self._error(400, f"bad request: {e}")
            except (ApiError, OSError) as e:
                # E.g. the API server refused to take a warm label off (then nothing was removed): say so,
                # rather than drop the connection without an answer.
                self._error(503, f"{self.path} failed: {e}")

        def _object(self) -> None:
            """One complete object for a peer's stager, streamed from the page cache (sendfile)."""
            try:
                req = ObjectRequest.parse(self.path)
                namespace, cache, revision, path = req.namespace, req.cache, req.revision, req.path
                check_request(namespace, cache, path)
            except (ValueError, ArgsError) as e:
                return self._error(400, f"bad request: {e}")
            given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if not check_peer_token(token() or "", namespace, cache, given):
                agent.metrics.peer_refused.inc()
                return self._error(401, f"objects of {namespace}/{cache} need that cache's peer token")
            c = agent.c(namespace, cache)
            try:
                opened = wait_for_object(c, revision, path, req.wait, _locked, claims, req.probe)
            except NotHere as e:
                return self._send(404, json.dumps({"state": e.state.value, "error": str(e)}).encode())
            except OSError as e:
                return self._error(503, f"cannot read {path}: {e}")
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(opened.size))
                self.send_header(REVISION_HEADER, revision)
                self.end_headers()
                self.wfile.flush()
                sent, sock = 0, self.connection.fileno()
                while sent < opened.size:
                    n = os.sendfile(sock, opened.fd, sent, opened.size - sent)
                    if n == 0:
                        break  # the file is shorter than it was: the peer sees a short body
                    sent += n
                agent.metrics.peer_served.inc(sent)
                if sent < opened.size:
                    self.close_connection = True
            finally:
                os.close(opened.fd)

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    return server
