"""`python -m dscache_operator uninstall`: the chart's pre-delete hook.

`helm uninstall` deletes the controller and the node agents. A DatasetCache
deleted after that keeps our finalizer forever (nobody is left to remove it)
and its node copies stay on disk (nobody is left to wipe them). So before Helm
deletes anything, this deletes every DatasetCache in the namespaces the
operator serves and waits, bounded, while the controller that still runs does
what it does for any deleted cache: waits for the pods that use it to end,
has each node's agent wipe its copy, and removes its finalizer. Done when no
DatasetCache is left; on the deadline it names what is left and why, and
fails, so `helm uninstall` stops with the release intact (run it again, or
`helm uninstall --no-hooks` to leave the copies and finalizers behind).

It writes nothing but DELETEs of DatasetCaches (the chart grants it list and
delete on them, nothing else), with the operator's own API client.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from typing import Any

import aiohttp

from ..api.models import FINALIZER, GROUP, NODE_MODES, PLURAL, VERSION, VolumeMode
from ..kube.client import ApiError, Kube, connection_info

logger = logging.getLogger("dscache.uninstall")


def caches_path(namespace: str | None) -> str:
    base = f"/apis/{GROUP}/{VERSION}"
    return f"{base}/namespaces/{namespace}/{PLURAL}" if namespace else f"{base}/{PLURAL}"


async def list_caches(kube: Kube, namespaces: list[str]) -> list[dict[str, Any]] | None:
    """Every DatasetCache in ``namespaces`` (all of them when empty); None: no such CRD."""
    items: list[dict[str, Any]] = []
    scopes: list[str | None] = list(namespaces) or [None]
    for ns in scopes:
        try:
            got = await kube.request("GET", caches_path(ns))
        except ApiError as e:
            if e.status == 404:
                return None
            raise
        items.extend(got.get("items") or [])
    return items


def describe(cache: dict[str, Any]) -> str:
    """What a cache still waits for, as far as its status says."""
    meta, status = cache["metadata"], cache.get("status") or {}
    copies = [
        n["node"]
        for n in status.get("nodes") or []
        if n.get("state") != "Wiped" and n.get("volume", VolumeMode.HOST_PATH) in NODE_MODES
    ]
    users = sum(int(n.get("consumers") or 0) for n in status.get("nodes") or [])
    parts = []
    if users:
        parts.append(f"{users} pod(s) still use it")
    if copies:
        parts.append(f"copies on {', '.join(sorted(copies))}")
    others = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
    if others:
        parts.append(f"other finalizers {', '.join(others)}")
    if not parts:
        parts.append("deleting" if meta.get("deletionTimestamp") else "not deleted yet")
    return f"{meta['namespace']}/{meta['name']} ({'; '.join(parts)})"


async def delete_all(kube: Kube, caches: list[dict[str, Any]]) -> None:
    for c in caches:
        meta = c["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        try:
            await kube.request(
                "DELETE",
                f"{caches_path(meta['namespace'])}/{meta['name']}",
                {"propagationPolicy": "Background"},
                answer=False,
            )
        except ApiError as e:
            if e.status != 404:
                raise


async def uninstall(kube: Kube, namespaces: list[str], timeout: float, interval: float = 2.0) -> int:
    """Delete every DatasetCache and wait until none is left; 0 when done, 1 on the deadline."""
    where = ", ".join(namespaces) if namespaces else "every namespace"
    caches = await list_caches(kube, namespaces)
    if caches is None:
        logger.info("no DatasetCache CRD in the cluster: nothing to delete")
        return 0
    total = len(caches)
    logger.info(f"deleting {total} DatasetCache(s) in {where}; the controller wipes their node copies")
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    last = ""
    while True:
        try:
            await delete_all(kube, caches)  # again each round: one created meanwhile is deleted too
            caches = await list_caches(kube, namespaces) or []
        except (aiohttp.ClientError, TimeoutError, ApiError) as e:
            if isinstance(e, ApiError) and e.status < 500 and e.status != 429:
                raise  # 403: the hook's RBAC is wrong; retrying will not help
            logger.warning(f"the API server did not answer ({e}); trying again")
            if time.monotonic() >= deadline:
                return 1
            await asyncio.sleep(interval)
            continue
        if not caches:
            logger.info(
                f"done in {time.monotonic() - started:.0f} s: {total} DatasetCache(s) deleted, "
                "their node copies wiped and finalizers removed by the controller"
            )
            return 0
        line = "; ".join(describe(c) for c in caches[:20]) + (
            f"; and {len(caches) - 20} more" if len(caches) > 20 else ""
        )
        if line != last:  # progress, not the same line every round
            logger.info(f"{len(caches)} of {total} left after {time.monotonic() - started:.0f} s: {line}")
            last = line
        if time.monotonic() >= deadline:
            logger.error(
                f"{len(caches)} DatasetCache(s) still there after {timeout:.0f} s: {line}. The controller must be "
                "running to wipe copies and remove its finalizer (its log says what it waits for; pods that "
                "use a cache hold it until they end). Run `helm uninstall` again, or `helm uninstall "
                "--no-hooks` to uninstall anyway and leave these copies and finalizers behind."
            )
            return 1
        await asyncio.sleep(interval)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m dscache_operator uninstall", description=__doc__)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the caches to go")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between looks")
    args = parser.parse_args(argv)
    # The namespaces the operator serves, as the controller reads them (DSCACHE_WATCH_NAMESPACES).
    namespaces = [n.strip() for n in os.environ.get("DSCACHE_WATCH_NAMESPACES", "").split(",") if n.strip()]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def run() -> int:
        kube = Kube(connection_info())
        try:
            return await uninstall(kube, namespaces, args.timeout, args.interval)
        finally:
            await kube.close()

    return asyncio.run(run())
