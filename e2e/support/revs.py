"""The on-node revision layout, as the e2e tests check it (contract/dscache_contract/paths.py).

    C = <cacheRoot>/<ns>/<cache>          the hostPath source; removed only with the DatasetCache
    C/revs/<rev>/data/                    the revision's objects (DSCACHE_DIR in the pod)
    C/revs/<rev>/meta/manifest.jsonl      DSCACHE_MANIFEST in the pod
    C/revs/<rev>/meta/complete            written last: presence = whole
    C/leases/<rev>/<pod-uid>              one lease per pod using <rev> on the node

A wipe after a Job removes C/revs/<rev> and C/leases/<rev>, never C (a running
pod's mount source); only deleting the DatasetCache removes C.
"""

from __future__ import annotations

import json
from typing import Any

from .kube import node_path_exists, wait_for

REVISION_ANNOTATION = "dscache.io/revision"  # dscache_contract.ANNOTATION_REVISION
META_MOUNT_PATH = "/var/run/dscache"  # dscache_contract.META_MOUNT_PATH


def pod_revision(pod: dict[str, Any]) -> str:
    """The revision the pod was admitted with (the webhook's annotation)."""
    rev = ((pod.get("metadata") or {}).get("annotations") or {}).get(REVISION_ANNOTATION)
    assert rev, f"pod {pod['metadata']['name']} carries no {REVISION_ANNOTATION} annotation"
    return rev


def rev_dir(c: str, rev: str) -> str:
    return f"{c}/revs/{rev}"


def complete_marker(c: str, rev: str) -> str:
    return f"{rev_dir(c, rev)}/meta/complete"


def manifest(c: str, rev: str) -> str:
    return f"{rev_dir(c, rev)}/meta/manifest.jsonl"


def lease(c: str, rev: str, pod_uid: str) -> str:
    return f"{c}/leases/{rev}/{pod_uid}"


def wait_revision_wiped(kube, ns: str, cache: str, c: str, rev: str, node: str | None, timeout: float = 90) -> None:
    """Wait until the node holds neither the revision nor a lease on it, then check that
    C itself (the mount source of any later pod) is still there."""

    def gone() -> bool:
        return not node_path_exists(rev_dir(c, rev), node) and not node_path_exists(f"{c}/leases/{rev}", node)

    def describe() -> str:
        obj = kube.get("datasetcache", cache, ns) or {}
        return (
            json.dumps(obj.get("status") or {}, indent=1)
            + "\n"
            + kube.kubectl("get", "pods", "-n", "dscache-system", "-o", "wide", check=False).stdout
        )

    wait_for(f"revision {rev} wiped from {c} on {node or 'the node'}", gone, timeout=timeout, describe=describe)
    assert node_path_exists(c, node), f"the wipe of {rev} removed the cache dir {c} itself"
