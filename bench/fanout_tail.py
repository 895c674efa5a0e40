#!/usr/bin/env python3
"""Where a fan-out run's tail goes (issue 30): ``python -P bench/fanout_tail.py WORKDIR RUN [K]``.

Reads what ``bench/fanout.py --nodes N --workdir WORKDIR`` keeps of the run ``RUN`` (e.g.
``scale-8``): ``logs/RUN-arrivals.json`` (every node's start and end, and when each object was
whole on each node: its file's mtime) and, when the stagers ran with ``DSCACHE_TRACE=1``, their
per-object peer requests (``obj <outcome> <peer> <path> h<hop> <ms>`` lines from sync's native
peer worker, ``obj-py`` from peers.obtain). Prints:
 - per kind of object (the first path component: ``large``, ``small``), when it was first whole
   anywhere (read from the bucket) and how long it then took to be whole on every node;
 - the bytes that became whole per second over all nodes (what the N links carried);
 - from ``logs/RUN-links.json`` (every link's byte counters every 0.1 s, netsim.LinkTimeline):
   when the bucket's link carried its bytes and at what rate, what share of their bytes the nodes
   had by its end (the rest is the peers' tail), and per second the bucket's and the nodes' mean
   downlink rates;
 - per serving node, how many objects of each kind it sent (a node that sends most copies is the
   run's bottleneck), and how long a large object took from its sender having it to placed;
 - the slowest node's last K objects: whom it asked, what each answered, and who held the object
   whole at that moment.
The trace's clock is CLOCK_MONOTONIC and the arrivals are epoch seconds: they are lined up by this
machine's offset between the two (the same machine ran the bench).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

#: (asked at, answered at, outcome, peer's node index, hop) of one request, seconds from the first start.
Ask = tuple[float, float, str, int, str]


def node_of(addr: str) -> int:
    """bench/netsim.py gives node i the address <subnet>.<10 + i>."""
    return int(addr.split(":")[0].rsplit(".", 1)[1]) - 10


def asks(logs: Path, run: str, nodes: list[str], t0: float) -> dict[tuple[str, str], list[Ask]]:
    """Every traced peer request, per (node, path)."""
    offset = time.time() - time.monotonic()
    out: dict[tuple[str, str], list[Ask]] = defaultdict(list)
    for n in nodes:
        for line in (logs / f"{run}-{n}.log").read_text(errors="replace").splitlines():
            p = line.split()
            if len(p) != 8 or p[0] != "dscache-trace" or p[2] not in ("obj", "obj-py"):
                continue
            end = float(p[1]) + offset - t0
            what = p[3] if p[2] == "obj" else f"py-{p[3]}"
            out[(n, p[5])].append((end - int(p[7]) / 1000, end, what, node_of(p[4]), p[6]))
    return out


def link_tail(links: dict[str, Any], t0: float, bucket: str = "bucket") -> dict[str, Any]:
    """What a run's link timeline (netsim.LinkTimeline.stop) says of its tail: when the bucket's
    link (host ``bucket``) had sent 1% and 99% of what it sent in the run (s from ``t0``), its
    rate between the two, and per node the share of what it received in the run that it had
    received by the bucket's 99% (the rest came from peers after the bucket was done); {} for a
    timeline without traffic."""
    t = [x - t0 for x in links["t"]]
    sent = [b - links["up"][bucket][0] for b in links["up"][bucket]]
    total = sent[-1]
    if len(t) < 2 or total <= 0:
        return {}
    first = next(i for i, b in enumerate(sent) if b >= 0.01 * total)
    last = next(i for i, b in enumerate(sent) if b >= 0.99 * total)
    busy = max(t[last] - t[first], links["interval_s"])
    had: dict[str, float] = {}
    for node, down in links["down"].items():
        if node == bucket or down[-1] <= down[0]:
            continue
        had[node] = round((down[last] - down[0]) / (down[-1] - down[0]), 3)
    return {
        "bucket_from_s": round(t[first], 2),
        "bucket_to_s": round(t[last], 2),
        "bucket_mbit": round(0.98 * total * 8 / busy / 1e6, 1),
        "end_s": round(t[-1], 2),
        "had_at_bucket_end": had,
    }


def per_second(links: dict[str, Any], t0: float, bucket: str = "bucket") -> list[str]:
    """``<s>:<bucket mbit>/<mean node downlink mbit>`` for each second of a link timeline."""
    t, up, down = links["t"], links["up"][bucket], links["down"]
    nodes = [n for n in down if n != bucket]
    out: list[str] = []
    i = 0
    for sec in range(int(t[-1] - t0) + 1):
        j = i
        while j + 1 < len(t) and t[j + 1] - t0 <= sec + 1:
            j += 1
        span = max(t[j] - t[i], 1e-9)
        bucket = (up[j] - up[i]) * 8 / span / 1e6
        mean = sum(down[n][j] - down[n][i] for n in nodes) * 8 / span / 1e6 / max(len(nodes), 1)
        out.append(f"{sec}:{bucket:.0f}/{mean:.0f}")
        i = j
    return out


def report(work: Path, run: str, last: int) -> None:
    data: dict[str, Any] = json.loads((work / "logs" / f"{run}-arrivals.json").read_text())
    starts: dict[str, float] = data["starts"]
    ends: dict[str, float] = data["ends"]
    arrivals: dict[str, dict[str, float]] = data["arrivals"]
    nodes = sorted(starts)
    t0 = min(starts.values())
    paths = sorted(arrivals[nodes[0]])
    first = {r: min(arrivals[n][r] for n in nodes) - t0 for r in paths}
    whole = {r: max(arrivals[n][r] for n in nodes) - t0 for r in paths}
    for kind in sorted({r.split("/", 1)[0] for r in paths}):
        rs = [r for r in paths if r.split("/", 1)[0] == kind]
        fs = sorted(first[r] for r in rs)
        spread = sorted(whole[r] - first[r] for r in rs)
        print(
            f"{kind}: {len(rs)} objects; first whole (bucket) q50 {fs[len(fs) // 2]:.1f} s, max {fs[-1]:.1f} s; "
            f"then whole everywhere after q50 {spread[len(spread) // 2]:.1f} s, max {spread[-1]:.1f} s"
        )
    per_s: Counter[int] = Counter()
    for n in nodes:
        for r in paths:
            per_s[int(arrivals[n][r] - t0)] += 1
    print("objects whole per second, all nodes:", " ".join(f"{s}:{per_s[s]}" for s in range(max(per_s) + 1)))
    own = {n: ends[n] - starts[n] for n in nodes}
    print("own time (start to exit), s:", {n[-2:]: round(v, 1) for n, v in own.items()})
    if (links_file := work / "logs" / f"{run}-links.json").exists():
        links = json.loads(links_file.read_text())
        tail = link_tail(links, t0)
        if tail:
            had = sorted(tail["had_at_bucket_end"].values())
            print(
                f"links: the bucket's link sent 98% of its bytes from {tail['bucket_from_s']:.1f} s to "
                f"{tail['bucket_to_s']:.1f} s ({tail['bucket_mbit']:.1f} mbit); by then the nodes had received "
                f"{had[0]:.0%}-{had[-1]:.0%} of their bytes, the rest from peers until {tail['end_s']:.1f} s"
            )
        print("per second, the bucket's mbit / the nodes' mean downlink mbit:", " ".join(per_second(links, t0)))
    traced = asks(work / "logs", run, nodes, t0)
    if not traced:
        print("(no per-object trace: run the bench with DSCACHE_TRACE=1)")
        return
    sent: Counter[tuple[int, str]] = Counter()
    hops: list[float] = []
    for (_n, r), seq in traced.items():
        for asked, end, what, peer, _ in seq:
            if what in ("placed", "py-placed"):
                kind = r.split("/", 1)[0]
                sent[(peer, kind)] += 1
                ready = arrivals[nodes[peer]][r] - t0
                hops.append(end - max(asked, ready))
    for kind in sorted({k for _, k in sent}):
        print(f"{kind} objects sent, per serving node:", sorted((p, c) for (p, k), c in sent.items() if k == kind))
    hops.sort()
    if hops:
        print(f"sender had it -> placed: q50 {hops[len(hops) // 2]:.2f} s, q90 {hops[int(len(hops) * 0.9)]:.2f} s")
    slow = max(nodes, key=lambda n: own[n])
    print(f"slowest: {slow}, {starts[slow] - t0:.2f} s to {ends[slow] - t0:.2f} s; its last {last} objects:")
    for r, at in sorted(arrivals[slow].items(), key=lambda kv: kv[1])[-last:]:
        held = " ".join(f"{m[-2:]}@{arrivals[m][r] - t0:.1f}" for m in sorted(nodes, key=lambda m: arrivals[m][r]))
        print(f" {r} whole here at {at - t0:.2f}; whole at: {held}")
        for asked, end, what, peer, hop in traced.get((slow, r), []):
            had = [m[-2:] for m in nodes if m != slow and arrivals[m][r] - t0 <= asked]
            print(f"    asked node {peer:02d} ({hop}) at {asked:.2f}: {what} at {end:.2f}; whole then at {had}")


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    report(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 10)


if __name__ == "__main__":
    main()
