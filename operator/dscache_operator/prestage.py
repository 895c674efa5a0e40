"""Pre-staging (spec.prestage): which nodes get the current revision ahead of any Job, and the pods that copy it.

A pre-stage pod is an ordinary consumer pod in the DatasetCache's own
namespace, pinned to its node (nodeName), injected exactly as a Job's pod is
(the same stager, credentials by secretKeyRef or the namespace's default
ServiceAccount identity: the tenant's Secret never leaves its namespace). It
takes no lease (a lease means "a pod reads this"): its copy is kept by the
controller's plan (``keep``) while prestage names the node, and may be evicted
by the node's byte budget like any unused copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any

import dscache_contract as contract
from dscache_contract import RevisionRef

from .injection import inject_object, stager_security_context
from .models import CONSUMER_LABEL, GROUP, KIND, VERSION, DatasetCacheSpec, Prestage, VolumeMode
from .nodes import NodeInfo, schedulable_for
from .settings import Settings

PRESTAGE_LABEL = f"{GROUP}/prestage"
POD_PREFIX = "dscache-prestage-"


def pod_name(namespace: str, cache: str, node: str, revision: str) -> str:
    digest = hashlib.sha256(f"{namespace}/{cache}/{node}/{revision}".encode()).hexdigest()[:20]
    return f"{POD_PREFIX}{digest}"


def choose(prestage: Prestage, nodes: Iterable[NodeInfo], namespace: str, cache: str, revision: str) -> list[NodeInfo]:
    """The nodes that should hold ``revision``: ready nodes with an agent that match the
    selector and whose taints the tolerations allow; those already warm first, then by
    name (stable, so a count does not wander between reconciliations)."""
    key = contract.warm_label(namespace, cache, revision)
    eligible = [
        n for n in nodes if n.ready and n.agent and schedulable_for(n, prestage.nodeSelector, prestage.tolerations)
    ]
    eligible.sort(key=lambda n: (key not in n.warm, n.name))
    return eligible[: prestage.nodes] if prestage.nodes else eligible


def build_pod(
    namespace: str,
    cache: str,
    owner_uid: str,
    node: str,
    spec: DatasetCacheSpec,
    settings: Settings,
    revision: RevisionRef,
    nbytes: int | None,
) -> dict[str, Any]:
    assert spec.prestage is not None
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(namespace, cache, node, revision.id),
            "namespace": namespace,
            "labels": {CONSUMER_LABEL: "true", PRESTAGE_LABEL: "true"},
            "annotations": {contract.ANNOTATION_CACHE: cache},
            # Deleted with the cache (garbage collection), and not a workload's pod.
            "ownerReferences": [
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": cache, "uid": owner_uid, "controller": True}
            ],
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "tolerations": [t.model_dump(exclude_none=True) for t in spec.prestage.tolerations],
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "prestaged",
                    "image": settings.stager_image,
                    "imagePullPolicy": settings.stager_pull_policy,
                    "command": ["python3", "-c", "print('pre-staged')"],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
                    "securityContext": stager_security_context(VolumeMode.EMPTY_DIR),  # non-root, no capability
                }
            ],
        },
    }
    inject_object(
        pod,
        kind="Pod",
        namespace=namespace,
        cache_name=cache,
        spec=spec,
        settings=settings,
        mode=VolumeMode.HOST_PATH,
        revision=revision,
        nbytes=nbytes,
    )
    # No lease: nothing on this pod reads the copy.
    init = pod["spec"]["initContainers"][0]
    args = contract.StageArgs.from_argv(init["args"])
    init["args"] = dataclasses.replace(args, pod_uid=None).to_argv()
    return pod
