"""Connections to node agents: TLS when the webhook gave the stager the agents' CA.

The chart makes one serving certificate for every agent, for the name
``AGENT_TLS_NAME`` (an agent is reached at its node's IP, which no certificate made
ahead of time can name): the certificate is checked against that name and the CA in
``DSCACHE_PEER_CA`` (PEM). Without it, plain HTTP (tests; the chart's
``nodeAgent.tls.enabled: false``). See docs/security.md for what this does and does not stop.
"""

from __future__ import annotations

import functools
import http.client
import os
import ssl

from dscache_contract.peers import AGENT_TLS_NAME, PEER_CA_ENV


@functools.lru_cache(maxsize=2)
def _context(pem: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=pem)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def context() -> ssl.SSLContext | None:
    """The client context for agents; None when no CA was given (plain HTTP)."""
    pem = (os.environ.get(PEER_CA_ENV) or "").strip()
    return _context(pem) if pem else None


class _AgentHTTPS(http.client.HTTPSConnection):
    """HTTPS to an IP whose certificate names AGENT_TLS_NAME (http.client checks the host it connects to)."""

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=AGENT_TLS_NAME)  # type: ignore[attr-defined]


def connection(host: str, port: int, timeout: float, tls: bool | None = None) -> http.client.HTTPConnection:
    """A connection to the agent at ``host:port``: TLS when ``tls`` (None: when a CA was given)."""
    ctx = context()
    if tls is None:
        tls = ctx is not None
    if not tls:
        return http.client.HTTPConnection(host, port, timeout=timeout)
    return _AgentHTTPS(host, port, timeout=timeout, context=ctx or ssl.create_default_context())
