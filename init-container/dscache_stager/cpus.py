"""How many CPUs this container may use: its cgroup CPU quota, not the node's count.

os.cpu_count() counts the node's CPUs: on a 192-core GPU node it says 192 to
an init container limited to 4 CPUs, and 192 busy threads would then be
throttled by the quota in turns. The quota is cgroup v2's ``cpu.max``
("max 100000" or "400000 100000") or cgroup v1's ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us`` (-1: none); the CPU affinity mask (cpusets, taskset)
bounds it too. Read once per run: a few small files.
"""

from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"


def available_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process may keep busy: min(affinity, cgroup quota), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cgroup_quota(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota in CPUs (2.5 for "250000 100000"), or None when there is none.

    Looks in this process's own cgroup first, then at the mount's root (in a
    container with its own cgroup namespace, the root is its own cgroup).
    The tightest quota found on the way up wins, as the kernel enforces it.
    """
    v2, v1 = _own_paths(proc_cgroup)
    quotas = [q for d in _candidates(root, v2) if (q := _v2_quota(d)) is not None]
    for base in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quotas += [q for d in _candidates(os.path.join(root, base), v1) if (q := _v1_quota(d)) is not None]
    return min(quotas) if quotas else None


def _own_paths(proc_cgroup: str) -> tuple[str, str]:
    """This process's cgroup path in the v2 hierarchy and in v1's cpu controller."""
    v2 = v1 = "/"
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path
                elif "cpu" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def _candidates(mount: str, own: str) -> list[str]:
    """The own cgroup's dir under ``mount`` and every ancestor up to the mount itself."""
    out = []
    rel = own.strip("/")
    while True:
        out.append(os.path.join(mount, rel) if rel else mount)
        if not rel:
            return out
        rel = rel.rpartition("/")[0]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(d: str) -> float | None:
    text = _read(os.path.join(d, "cpu.max"))
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or "100000")
    except (ValueError, ZeroDivisionError):
        return None


def _v1_quota(d: str) -> float | None:
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
