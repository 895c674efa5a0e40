"""The controller phase's instruments: which caches have converged, and where the time went.

Why a watch and not a list every few seconds: listing 10,000 caches with their status
costs the API server (on the same two cores as the controller under test) over a second
of CPU each time, and parsing 30 MB costs the bench as much: the measurement slowed what
it measured. One list and a watch cost about one event per status write, which the API
server serializes once for every watcher (the controller watches the same events).
The count is checked against a full list once at the end.

Where the time went: the CPU of each process on the cores (/proc/<pid>/stat), and the
controller's API requests by verb and resource, from the API server's audit log.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.procstat import cpu_seconds

CACHES = "/apis/dscache.io/v1alpha1/datasetcaches"


def counted(ns: str) -> bool:
    """The populated caches only: the webhook's "hot" cache (bench-hook, patched Ready by
    hand) must not count towards convergence."""
    return ns.startswith("bench-") and ns != "bench-hook"


def converged_state(obj: dict[str, Any]) -> tuple[bool, bool]:
    """(Ready, has node entries) of one DatasetCache."""
    status = obj.get("status") or {}
    return status.get("phase") == "Ready", bool(status.get("nodes"))


class ConvergenceWatch:
    """Follows every DatasetCache's (Ready, has nodes) with one list and a watch, in a thread."""

    def __init__(self, k: Any) -> None:
        self.k = k
        self._state: dict[str, tuple[bool, bool]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="convergence-watch", daemon=True)
        self.errors = 0

    def start(self) -> ConvergenceWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            states = list(self._state.values())
        return sum(r for r, _ in states), sum(n for _, n in states)

    def _put(self, obj: dict[str, Any], deleted: bool = False) -> None:
        meta = obj.get("metadata") or {}
        if not counted(meta.get("namespace", "")):
            return
        with self._lock:
            if deleted:
                self._state.pop(meta.get("uid", ""), None)
            else:
                self._state[meta.get("uid", "")] = converged_state(obj)

    def _list(self) -> str:
        cont = ""
        fresh: dict[str, tuple[bool, bool]] = {}
        while True:
            params = {"limit": "1000"} | ({"continue": cont} if cont else {})
            data = self.k.request("GET", CACHES, params=params)
            for obj in data.get("items") or []:
                if counted(obj["metadata"]["namespace"]):
                    fresh[obj["metadata"]["uid"]] = converged_state(obj)
            cont = (data.get("metadata") or {}).get("continue") or ""
            if not cont:
                with self._lock:
                    self._state = fresh
                return str(data["metadata"]["resourceVersion"])

    def _watch(self, rv: str) -> str:
        conn = http.client.HTTPSConnection("127.0.0.1", self.k.port, context=self.k._ssl(), timeout=60)
        try:
            conn.request(
                "GET",
                f"{CACHES}?watch=1&allowWatchBookmarks=true&timeoutSeconds=600&resourceVersion={rv}",
                headers={"Accept": "application/json"},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"watch: HTTP {resp.status}")
            while not self._stop.is_set():
                line = resp.readline()
                if not line:
                    return rv
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return ""  # 410 Gone: list again
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self._put(obj, deleted=event["type"] == "DELETED")
            return rv
        finally:
            conn.close()

    def _run(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                rv = rv or self._list()
                rv = self._watch(rv)
            except Exception:
                self.errors += 1
                rv = ""
                time.sleep(1)


def count_listed(k: Any) -> tuple[int, int]:
    """(Ready, with node entries) from one full list: the check of the watch's count."""
    items = [c for c in k.request("GET", CACHES)["items"] if counted(c["metadata"]["namespace"])]
    states = [converged_state(c) for c in items]
    return sum(r for r, _ in states), sum(n for _, n in states)


class CpuMeter:
    """CPU seconds each named process used since ``start`` (a process that died reads as what it last had)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        out = {"bench": sum(os.times()[:2])}  # this process: the populate threads, the watch
        for name, pid in self.pids.items():
            try:
                out[name] = cpu_seconds(pid)
            except OSError:
                out[name] = 0.0
        return out

    def used(self) -> dict[str, float]:
        now = self._read()
        return {name: round(now[name] - self._start.get(name, 0.0), 1) for name in now}


def controller_requests(audit_log: Path, user: str, since: float, until: float) -> dict[str, int]:
    """The controller's API requests between two wall-clock times, by "verb resource[/subresource]"."""
    import datetime

    counts: collections.Counter[str] = collections.Counter()
    if not audit_log.exists():
        return {}
    with audit_log.open() as f:
        for line in f:
            if user not in line or '"ResponseComplete"' not in line:
                continue
            e = json.loads(line)
            if e.get("stage") != "ResponseComplete" or e.get("user", {}).get("username") != user:
                continue
            at = datetime.datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            if not since <= at <= until:
                continue
            ref = e.get("objectRef") or {}
            what = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            code = (e.get("responseStatus") or {}).get("code", 0)
            counts[f"{e.get('verb')} {what}" + ("" if code < 400 else f" {code}")] += 1
    return dict(counts.most_common())


def source_counts(metrics_port: int) -> dict[str, int]:
    """The controller's source checks, and the S3 listings they made, from its /metrics
    (at 10,000 caches rendering it takes seconds on busy cores: a long timeout, and {} if it fails)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=120) as r:
            metrics_text = r.read().decode()
    except OSError:
        return {}
    out = {"checks": 0, "listings": 0}
    for line in metrics_text.splitlines():
        if line.startswith("dscache_source_checks_total{"):
            out["checks"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("dscache_source_listings_total "):
            out["listings"] = int(float(line.rsplit(" ", 1)[1]))
    return out
