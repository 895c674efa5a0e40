"""The agent's HTTP API on the host network (contract: dscache_contract.node).

GET  /healthz       200 while the disk was read lately
GET  /metrics       Prometheus
POST /v1/reserve    the stager: room for a copy (no token; see SECURITY.md)
POST /v1/wipe       the controller: release leases, remove a revision (token required)
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dscache_contract import RESERVE_PATH, WIPE_PATH, ArgsError, ReserveRequest, WipeRequest
from dscache_stager.errors import BusyError, UsageError

from .agent import Agent
from .kube import ApiError

log = logging.getLogger("dscache-node")
MAX_BODY = 1 << 20


def make_server(agent: Agent, token: Callable[[], str | None], port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    """``token()``: the token wipes must carry, read afresh per request (a rotated Secret
    takes effect without a restart)."""

    class Handler(BaseHTTPRequestHandler):
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

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    return server
