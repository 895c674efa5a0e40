"""A lean Kubernetes API client on the standard library.

Why not the official ``kubernetes`` package: measured on this image's Python,
importing it and building a CoreV1Api took the process from 8 to 65 MiB RSS,
against 20 MiB for http.client + ssl + json; the agent runs on every node, and
it needs five calls (get, merge-patch, post, list and watch).

Connections are kept alive and reused (at most ``IDLE_MAX`` idle ones): a new TLS
handshake per call cost the agent and the API server more CPU than the calls themselves
when every stager asks its agent who its peers are several times a second (issue 30).

In a pod it uses the ServiceAccount token (re-read on every request: kubelet
rotates it) and CA. Out of a cluster (integration tests): DSCACHE_KUBE_SERVER
with DSCACHE_KUBE_CA and either DSCACHE_KUBE_CERT/DSCACHE_KUBE_KEY or
DSCACHE_KUBE_TOKEN_FILE.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("dscache-node")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: A call that took this long is logged.
SLOW_CALL_S = 2.0
#: Idle connections kept for reuse: one per thread that calls (the server's control and check
#: pools). At a cohort's start both pools call at once, for seconds (issue 30); with 4 kept, every
#: burst past 4 paid a TLS handshake per call on a CPU-bound API server.
IDLE_MAX = 16
#: An idle connection older than this is closed rather than reused (the server may have dropped it).
IDLE_S = 30.0
#: What a reused connection raises when the server closed it while it was idle: the request never
#: reached the server, so it is sent once more on a new connection.
_STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
)


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Kube:
    def __init__(self, server: str, ctx: ssl.SSLContext, token_file: str | None, timeout: float = 10.0) -> None:
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname or "localhost", url.port or 443
        self.ctx, self.token_file, self.timeout = ctx, token_file, timeout
        self._idle: list[tuple[float, http.client.HTTPSConnection]] = []
        self._idle_lock = threading.Lock()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Kube:
        env = dict(os.environ if env is None else env)
        if env.get("DSCACHE_KUBE_SERVER"):
            ctx = ssl.create_default_context(cafile=env.get("DSCACHE_KUBE_CA"))
            if env.get("DSCACHE_KUBE_CERT"):
                ctx.load_cert_chain(env["DSCACHE_KUBE_CERT"], env.get("DSCACHE_KUBE_KEY"))
            return cls(env["DSCACHE_KUBE_SERVER"], ctx, env.get("DSCACHE_KUBE_TOKEN_FILE"))
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a cluster (no KUBERNETES_SERVICE_HOST) and DSCACHE_KUBE_SERVER is not set")
        ctx = ssl.create_default_context(cafile=f"{SA_DIR}/ca.crt")
        return cls(f"https://{host}:{port}", ctx, f"{SA_DIR}/token")

    def _headers(self, content_type: str | None = None, accept: str = "application/json") -> dict[str, str]:
        h = {"Accept": accept}
        if self.token_file:
            with open(self.token_file) as f:
                h["Authorization"] = f"Bearer {f.read().strip()}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> dict[str, Any] | None:
        """One call; None on 404; ApiError on any other failure. ``accept``: a JSON media type
        (the API server serves its key set only as application/jwk-set+json: 406 otherwise)."""
        data = json.dumps(body).encode() if body is not None else None
        headers = self._headers(content_type if data else None, accept)
        started = time.monotonic()
        try:
            return self._request(method, path, data, headers)
        finally:
            took = time.monotonic() - started
            if took >= SLOW_CALL_S:
                # Calls take milliseconds on a healthy API server; the agent's callers (a stager
                # asking for its peers, a peer's token check) wait seconds if not (issue 30).
                log.info(f"the API server took {took:.1f} s to answer {method} {path.split('?')[0]}")

    def _request(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> dict[str, Any] | None:
        conn, reused = self._take()
        try:
            try:
                status, text, keep = self._exchange(conn, method, path, data, headers)
            except _STALE:
                if not reused:
                    raise
                conn.close()
                conn = self._connect()
                status, text, keep = self._exchange(conn, method, path, data, headers)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._give(conn)
        else:
            conn.close()
        if status == 404:
            return None
        if status >= 300:
            raise ApiError(status, text)
        out: dict[str, Any] = json.loads(text) if text else {}
        return out

    @staticmethod
    def _exchange(
        conn: http.client.HTTPSConnection, method: str, path: str, data: bytes | None, headers: dict[str, str]
    ) -> tuple[int, str, bool]:
        """(status, body, whether the connection may be reused)."""
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        return resp.status, text, not resp.will_close

    def _connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=self.timeout)

    def _take(self) -> tuple[http.client.HTTPSConnection, bool]:
        """An idle connection (reused: True) or a new one."""
        now = time.monotonic()
        with self._idle_lock:
            while self._idle:
                at, conn = self._idle.pop()
                if now - at < IDLE_S:
                    return conn, True
                conn.close()
        return self._connect(), False

    def _give(self, conn: http.client.HTTPSConnection) -> None:
        with self._idle_lock:
            if len(self._idle) < IDLE_MAX:
                self._idle.append((time.monotonic(), conn))
                return
        conn.close()

    def get(self, path: str, accept: str = "application/json") -> dict[str, Any] | None:
        return self.request("GET", path, accept=accept)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        return self.request("POST", path, body)

    def watch(self, path: str, timeout_seconds: int = 300) -> Iterator[dict[str, Any]]:
        """Stream watch events (one JSON object per line) until the server ends the watch."""
        sep = "&" if "?" in path else "?"
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=timeout_seconds + 30)
        try:
            conn.request("GET", f"{path}{sep}watch=1&timeoutSeconds={timeout_seconds}", headers=self._headers())
            resp = conn.getresponse()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.read().decode(errors="replace"))
            while line := resp.readline():
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
