"""JSON requests to this node's agent (dscache-node) on the node's IP: reservations, peers."""

from __future__ import annotations

import http.client
import ssl
import urllib.parse

from . import agenttls

#: How long a stager's first question for its peers may take when it was retried after the usual
#: timeout: a safety net for an agent slowed by a cohort's start (issue 30), not its remedy.
FIRST_RETRY_S = 20.0
#: What a kept-alive connection raises when the agent closed it while it was idle: the request never
#: reached the agent, so it is sent once more on a new connection.
STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
)


class AgentConnection:
    """One connection to ``agent``, kept between requests (the stager asks its agent who its peers
    are five times a second while the cohort forms, then every second: a TCP and TLS handshake per
    question cost both sides more than the question). ``https://``: TLS, checked against the agents'
    CA (agenttls.py)."""

    def __init__(self, agent: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(agent)
        self.tls = url.scheme == "https"
        self.host, self.port = url.hostname or "localhost", url.port or (443 if self.tls else 80)
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: str, token: str = "", timeout: float | None = None) -> str:
        """POST ``body`` with the pod's projected ``token`` (the agent writes to its Node or its disk
        only for a consumer pod of the cache on its node); the answer's text. A kept connection the
        agent closed while idle is opened anew once. OSError when the agent does not answer (within
        ``timeout``, else the connection's) or answers anything but 200 (with the status and the
        start of its answer)."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for attempt in (0, 1):
            conn, reused = self._conn, self._conn is not None
            if conn is None:
                conn = agenttls.connection(self.host, self.port, self.timeout, self.tls)
            conn.timeout = timeout or self.timeout  # a kept connection: set back to its own
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            self._conn = None
            try:
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                text = resp.read().decode(errors="replace")
            except STALE:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self._conn = conn
            if resp.status != 200:
                raise OSError(f"HTTP {resp.status}: {text[:200]}")
            return text
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def post(agent: str, path: str, body: str, timeout: float, token: str = "") -> str:
    """One request on a connection of its own (AgentConnection.post)."""
    conn = AgentConnection(agent, timeout)
    try:
        return conn.post(path, body, token)
    finally:
        conn.close()
