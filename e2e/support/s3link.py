"""The S3 container's link to the nodes, from the host: limit it (tc tbf in the container's own
network namespace) and read what it sent (its interface counter: the bucket's side of a copy)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

S3_CONTAINER = f"{os.environ.get('DSCACHE_KIND_CLUSTER', 'dscache-e2e')}-s3"


def _s3_pid() -> int:
    p = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Pid}}", S3_CONTAINER], capture_output=True, text=True, check=True
    )
    return int(p.stdout.strip())


def s3_sent_bytes() -> int:
    """Bytes the S3 container has sent on its interface (its own network namespace's counter)."""
    with open(f"/proc/{_s3_pid()}/net/dev") as f:
        lines = f.read().splitlines()
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            return int(rest.split()[8])
    raise AssertionError(f"no eth0 in {S3_CONTAINER}'s network namespace")


@contextlib.contextmanager
def bucket_link(mbit: int) -> Iterator[None]:
    """Limit what the S3 container sends (tc tbf on its eth0), for the duration."""
    ns = ["nsenter", "-t", str(_s3_pid()), "-n", "tc", "qdisc"]
    subprocess.run(
        [*ns, "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb", "latency", "200ms"],
        check=True,
    )
    try:
        yield
    finally:
        subprocess.run([*ns, "del", "dev", "eth0", "root"], check=False)
