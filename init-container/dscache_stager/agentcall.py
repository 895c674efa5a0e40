"""One JSON request to this node's agent (dscache-node) on the node's IP: reservations, peers."""

from __future__ import annotations

import urllib.parse

from . import agenttls


def post(agent: str, path: str, body: str, timeout: float, token: str = "") -> str:
    """POST ``body`` to ``agent`` + ``path``, with the pod's projected ``token`` (the agent writes to
    its Node or its disk only for a consumer pod of the cache on its node); the answer's text.
    ``https://``: TLS, checked against the agents' CA (agenttls.py). OSError when the agent
    does not answer or answers anything but 200 (with the status and the start of its answer)."""
    url = urllib.parse.urlsplit(agent)
    tls = url.scheme == "https"
    conn = agenttls.connection(url.hostname or "localhost", url.port or (443 if tls else 80), timeout, tls)
    try:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    finally:
        conn.close()
    if resp.status != 200:
        raise OSError(f"HTTP {resp.status}: {text[:200]}")
    return text
