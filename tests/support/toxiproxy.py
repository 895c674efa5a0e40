"""Toxiproxy (Shopify's latency proxy, in Go) in front of a server, for the benchmark's wan profile.

Why not our own faultproxy.py here: its asyncio pipe runs in the benchmark's
Python process and spends CPU per connection, and s5cmd opens a connection
per request where dscache keeps ~70 alive; on two shared cores that cost
lowered s5cmd's figure rather than measuring the client. Toxiproxy is a
neutral third party (built from source by e2e/tools/tools.sh through the Go
module proxy), its CPU is its own process's, and it adds the same latency to
every request: half the round trip on each direction's data.

Connections are counted from its own log ("Accepted client", one per
connection at the info level), so the bench can still say how many each tool
opened.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .s3server import free_port
from .tools import stop_process, tool_bin


@dataclass
class ToxiProxy:
    """``toxiproxy-server`` proxying 127.0.0.1:<port> to ``upstream`` with ``rtt_ms`` of added round trip."""

    upstream: tuple[str, int]
    rtt_ms: float
    port: int = 0
    api_port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def version(self) -> str:
        return tool_bin("toxiproxy").parent.name  # e.g. toxiproxy-v2.12.0 (tools.sh's cache key)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _api(self, path: str, body: dict) -> None:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.api_port}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def start(self) -> ToxiProxy:
        binary = tool_bin("toxiproxy") / "toxiproxy-server"
        self.port, self.api_port = self.port or free_port(), self.api_port or free_port()
        fd, name = tempfile.mkstemp(prefix="toxiproxy-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(binary), "-host", "127.0.0.1", "-port", str(self.api_port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "LOG_LEVEL": "info"},
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                host, port = self.upstream
                self._api("/proxies", {"name": "s3", "listen": f"127.0.0.1:{self.port}", "upstream": f"{host}:{port}"})
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"toxiproxy-server did not start; see {self.log_path}") from None
                time.sleep(0.1)
        half = round(self.rtt_ms / 2)  # whole milliseconds: toxiproxy's latency is an integer
        for stream in ("upstream", "downstream"):
            self._api(
                "/proxies/s3/toxics",
                {"name": f"rtt_{stream}", "type": "latency", "stream": stream, "attributes": {"latency": half}},
            )
        return self

    def connections(self) -> int:
        """Client connections accepted so far."""
        assert self.log_path is not None
        with open(self.log_path, "rb") as f:
            return sum(1 for line in f if b'"Accepted client"' in line)

    def stop(self) -> None:
        stop_process(self.proc)
        if self.log_path:
            self.log_path.unlink(missing_ok=True)
