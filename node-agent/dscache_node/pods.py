"""This node's consumer pods, watched: which of them finished (their leases can go)."""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse

from dscache_contract import LABEL_CONSUMER

from .agent import PodView
from .kube import Kube

log = logging.getLogger("dscache-node")

CONSUMER_SELECTOR = f"{LABEL_CONSUMER}=true"
FINISHED = ("Succeeded", "Failed")


def watch_forever(kube: Kube, node: str, view: PodView, stop: threading.Event) -> None:
    """List, then watch from that list's version; on any error, list again (the view is
    marked unsynced meanwhile, so no lease is released on a stale view)."""
    query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}", "labelSelector": CONSUMER_SELECTOR})
    path = f"/api/v1/pods?{query}"
    while not stop.is_set():
        try:
            listed = kube.get(path) or {}
            view.finished = {
                p["metadata"]["uid"]: (p.get("status") or {}).get("phase") in FINISHED
                for p in listed.get("items") or []
            }
            view.synced = True
            version = (listed.get("metadata") or {}).get("resourceVersion", "")
            for event in kube.watch(f"{path}&resourceVersion={version}&allowWatchBookmarks=true"):
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    break  # e.g. 410 Gone: list again
                uid = (pod.get("metadata") or {}).get("uid")
                if not uid:
                    continue
                if kind == "DELETED":
                    view.finished[uid] = True  # gone: reads nothing any more
                elif kind in ("ADDED", "MODIFIED"):
                    view.finished[uid] = (pod.get("status") or {}).get("phase") in FINISHED
                if stop.is_set():
                    return
        except Exception as e:  # the API server restarts, the network blips: never die for it
            view.synced = False
            log.warning(f"watching this node's pods failed ({e}); listing again in 2 s")
            stop.wait(2.0)
        else:
            time.sleep(0.1)
