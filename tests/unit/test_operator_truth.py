"""Webhook behaviour with a real (unreachable) connection, and the informer's 410 handling.

No mocked client here: the webhook's own Kube client (aiohttp) connects to a
TCP port on this machine that refuses connections, exactly what it meets when
the API server is down.
"""

from __future__ import annotations

import socket

import kopf
import pytest

from dscache_operator.kube.client import Kube
from tests.unit.test_operator_injection import FakeIndex, job, run_mutate


def _closed_port() -> int:
    """A port nothing listens on (bound, then released: connect() gets ECONNREFUSED)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_api_unreachable_on_a_miss_fails_closed():
    """Index miss + API server refusing connections: the Job is refused, retryably."""
    port = _closed_port()
    info = kopf.ConnectionInfo(server=f"https://127.0.0.1:{port}", token="t")
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(job(), FakeIndex(), kube=Kube(info))
    msg = str(e.value)
    assert "DatasetCache ml/imagenet: dscache could not look it up" in msg, msg
    assert "retry" in msg and f"127.0.0.1:{port}" in msg, msg
    assert e.value.code == 503
