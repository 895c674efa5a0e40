"""The scale bench's arithmetic (issue 30), apart from any process or link so unit tests can pin it.

Per-object latency is read off each node's copy, not from the stager's own report:
 - ``arrivals``: an object's arrival on a node is its file's mtime (the stager writes the body
   into a temp file and renames it into place; a rename keeps the mtime, and nothing sets it);
 - ``propagation``: for each (node, object), the arrival on that node minus the later of the
   node's own start and the object's first arrival on any node: how long an object took to
   reach a node once it existed in the cluster and that node was asking for it. The node that
   read it first counts 0 (its bucket read is in ``write_s``, and in its all-ready time);
 - ``write_s``: statx birth time to mtime of the file: from the temp file's creation (the
   response's headers are in) to its last byte.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

AT_FDCWD = -100
STATX_MTIME = 0x40
STATX_BTIME = 0x800
_libc = ctypes.CDLL(None, use_errno=True)


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no samples."""
    s = sorted(xs)
    if not s:
        return 0.0
    rank = max(1, math.ceil(q * len(s)))
    return s[min(rank, len(s)) - 1]


def propagation(arrivals: Mapping[str, Mapping[str, float]], starts: Mapping[str, float]) -> list[float]:
    """Per (node, object): arrival - max(node's start, the object's first arrival anywhere)."""
    first: dict[str, float] = {}
    for objs in arrivals.values():
        for path, t in objs.items():
            first[path] = min(t, first.get(path, t))
    out = []
    for node, objs in arrivals.items():
        for path, t in objs.items():
            out.append(max(0.0, t - max(starts[node], first[path])))
    return out


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def birth_and_mtime(path: str) -> tuple[float, float]:
    """(birth, mtime) of ``path`` in epoch seconds (statx; birth 0.0 where the filesystem has none)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(AT_FDCWD, os.fsencode(path), 0, STATX_BTIME | STATX_MTIME, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    mask = int.from_bytes(buf.raw[0:4], "little")

    def ts(off: int) -> float:
        sec = int.from_bytes(buf.raw[off : off + 8], "little", signed=True)
        nsec = int.from_bytes(buf.raw[off + 8 : off + 12], "little")
        return sec + nsec / 1e9

    # struct statx: stx_btime at offset 80, stx_mtime at 112 (16 bytes each: sec, nsec, reserved).
    return (ts(80) if mask & STATX_BTIME else 0.0), ts(112)


def predict(by_nodes: Mapping[int, Mapping[str, float]], key: str, at: int) -> float | None:
    """``key`` extrapolated to ``at`` nodes, linear in log2(N) through the two largest N measured
    (a tree of copies grows by one level per doubling); None with fewer than two points."""
    ns = sorted(by_nodes)
    if len(ns) < 2:
        return None
    n1, n2 = ns[-2], ns[-1]
    y1, y2 = by_nodes[n1][key], by_nodes[n2][key]
    slope = (y2 - y1) / (math.log2(n2) - math.log2(n1))
    return round(y2 + slope * (math.log2(at) - math.log2(n2)), 3)


def access_get(line: str) -> tuple[str, str] | None:
    """(client IP, key) of a GetObject line of versitygw's access log (S3's server access log
    format: owner, bucket, [time], remote IP, requester, request id, operation, key, ...)."""
    head, sep, rest = line.partition("] ")
    if not sep or "[" not in head:
        return None
    fields = rest.split(" ")
    if len(fields) < 5 or fields[3] != "s3_GetObject":
        return None
    return fields[0], fields[4]


def bucket_reads(
    gets: Iterable[tuple[str, str]], node_of_ip: Mapping[str, str], sizes: Mapping[str, int]
) -> dict[str, Any]:
    """Who read what from the bucket, from the server's own log: per node the keys and bytes it
    read, and the keys more than one node read (each extra read is bytes the bucket sent twice)."""
    readers: dict[str, set[str]] = {}
    for ip, key in gets:
        readers.setdefault(key, set()).add(node_of_ip.get(ip, ip))
    per_node: dict[str, dict[str, int]] = {}
    for key, nodes in readers.items():
        for n in nodes:
            d = per_node.setdefault(n, {"objects": 0, "bytes": 0})
            d["objects"] += 1
            d["bytes"] += sizes.get(key, 0)
    dup = {k: sorted(v) for k, v in readers.items() if len(v) > 1}
    return {
        "keys_read": len(readers),
        "per_node": dict(sorted(per_node.items())),
        "keys_read_twice_or_more": len(dup),
        "extra_bytes": sum(sizes.get(k, 0) * (len(v) - 1) for k, v in dup.items()),
        "extra_reads_by_pair": _pairs(dup),
    }


def _pairs(dup: Mapping[str, list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for nodes in dup.values():
        key = "+".join(nodes)
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:10])
