"""Pre-staging (spec.prestage): which nodes get the current revision ahead of any Job, and the pods that copy it.

A pre-stage pod is an ordinary consumer pod in the DatasetCache's own
namespace, pinned to its node (nodeName), injected exactly as a Job's pod is
(the same stager, credentials by secretKeyRef or the namespace's default
ServiceAccount identity: the tenant's Secret never leaves its namespace). It
takes no lease (a lease means "a pod reads this"): its copy is kept by the
controller's plan (``keep``) while prestage names the node, and may be evicted
by the node's byte budget like any unused copy. ``keep`` (run by each
reconciliation) creates and replaces those pods and says how far it got.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import dscache_contract as contract
from dscache_contract import LABEL_CONSUMER, RevisionRef
from dscache_contract.clock import parse_time

from ..admission.injection import WebIdentity, inject_object, stager_security_context
from ..api.models import (
    GROUP,
    KIND,
    VERSION,
    DatasetCacheSpec,
    PodPhase,
    Prestage,
    PrestageStatus,
    VolumeMode,
)
from ..cluster.caches import CacheView
from ..cluster.identity import IdentityError
from ..cluster.nodes import NodeInfo, schedulable_for
from ..cluster.workloads import InitState, PodInfo
from ..kube.client import ApiError
from ..settings import Settings

if TYPE_CHECKING:
    from ..context import Context
    from .state import ControlContext

PRESTAGE_LABEL = f"{GROUP}/prestage"
POD_PREFIX = "dscache-prestage-"
#: A pre-stage pod that succeeded while its node is still not warm is replaced after this long.
PRESTAGE_RETRY_S = 300.0
#: A failed pre-stage pod is replaced after this long (its message is in status meanwhile).
PRESTAGE_FAILED_RETRY_S = 60.0

logger = logging.getLogger(__name__)


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


def _pull_secrets(settings: Settings, prestage: Prestage) -> dict[str, Any]:
    """The chart's pull secrets, then the cache's, each once: all by name, Secrets of the
    cache's namespace (a pod can use no other), so the cache's own are its tenant's."""
    names = dict.fromkeys([*settings.image_pull_secrets, *(r.name for r in prestage.imagePullSecrets)])
    return {"imagePullSecrets": [{"name": n} for n in names]} if names else {}


def build_pod(
    namespace: str,
    cache: str,
    owner_uid: str,
    node: str,
    spec: DatasetCacheSpec,
    settings: Settings,
    revision: RevisionRef,
    nbytes: int | None,
    web_identity: WebIdentity | None = None,
) -> dict[str, Any]:
    """``web_identity``: a pod-identity cache's (its ServiceAccount's role): the pod runs as that
    ServiceAccount, whose role the source check proved may read the bucket."""
    assert spec.prestage is not None
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(namespace, cache, node, revision.id),
            "namespace": namespace,
            "labels": {LABEL_CONSUMER: "true", PRESTAGE_LABEL: "true"},
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
            **_pull_secrets(settings, spec.prestage),
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
        mode=settings.node_mode,
        revision=revision,
        nbytes=nbytes,
        web_identity=web_identity,
    )
    if web_identity is not None and spec.source.serviceAccountName:
        pod["spec"]["serviceAccountName"] = spec.source.serviceAccountName
    # No lease once it is done: nothing on this pod reads the copy. (A CSI volume's lease
    # lasts while the pod runs, a second or so: the kubelet unpublishes a finished pod's volumes.)
    init = pod["spec"]["initContainers"][0]
    args = contract.StageArgs.from_argv(init["args"])
    # --prestage: the agent makes room for it by evicting no other pre-staged copy (nor one in use);
    # it refuses instead, and the pod's failure is this cache's status (no two caches take turns).
    # --cohort with peers: the controller creates the pre-stage pods of every chosen node at once.
    cohort = args.peer_token_file is not None
    init["args"] = dataclasses.replace(args, pod_uid=None, prestage=True, cohort=cohort).to_argv()
    return pod


# --- keeping the chosen nodes pre-staged (the controller runs this in each reconciliation) ---


async def keep(
    ctx: ControlContext,
    view: CacheView,
    cache: DatasetCacheSpec,
    revision: RevisionRef,
    nbytes: int | None,
    chosen: list[NodeInfo],
    pods: list[PodInfo],
    now: datetime.datetime,
) -> dict[str, Any]:
    """Make every chosen node hold ``revision``: one pre-stage pod per node that does not yet.

    A succeeded pod whose node is still not warm (its copy was evicted, or the agent has
    not labelled it yet) is replaced after PRESTAGE_RETRY_S; a failed one after
    PRESTAGE_FAILED_RETRY_S, its message shown meanwhile."""
    kube = ctx.api()
    namespace, name = view.key
    key = contract.warm_label(namespace, name, revision.id)
    mine = {p.name: p for p in pods if p.name.startswith(POD_PREFIX)}
    web_identity = None
    if cache.source.serviceAccountName and not cache.source.secret_name:
        try:
            role = await ctx.sources.identities.role(kube, namespace, cache.source.serviceAccountName)
        except IdentityError as e:
            return PrestageStatus(wanted=len(chosen), ready=0, message=e.message[:4000]).model_dump(exclude_none=True)
        web_identity = WebIdentity(role, ctx.settings.sts_audience, ctx.settings.sts_endpoint)
    wanted_names = set()
    ready, problems = 0, []
    for node in chosen:
        wanted = pod_name(namespace, name, node.name, revision.id)
        wanted_names.add(wanted)
        if key in node.warm:
            ready += 1
            continue
        pod = mine.get(wanted)
        if pod is None:
            body = build_pod(namespace, name, view.uid, node.name, cache, ctx.settings, revision, nbytes, web_identity)
            try:
                if await kube.create_pod(namespace, body) is not None:
                    logger.info(f"{namespace}/{name}: pre-staging {revision.id} onto node {node.name} (pod {wanted})")
            except ApiError as e:
                problems.append(f"{node.name}: cannot create the pre-stage pod: {e}")
            continue
        finished = parse_time(pod.init_finished)
        age = (now - finished).total_seconds() if finished else 0.0
        if pod.phase == PodPhase.FAILED or pod.init == InitState.FAILED:
            problems.append(f"{node.name}: {pod.message or 'the pre-stage pod failed'}")
            if age > PRESTAGE_FAILED_RETRY_S:
                await kube.delete_pod(namespace, wanted)
        elif pod.phase == PodPhase.SUCCEEDED and age > PRESTAGE_RETRY_S:
            await kube.delete_pod(namespace, wanted)  # staged, yet not warm: stage again
    await drop_pods(ctx, namespace, pods, keep=wanted_names)
    ctx.metrics.set_prestaged(namespace, name, {n.name: nbytes or 0 for n in chosen if key in n.warm})
    message = None
    if not chosen:
        message = "no ready node with a dscache-node agent matches spec.prestage (nodeSelector, tolerations)"
    elif problems:
        message = "; ".join(problems)[:4000]
    return PrestageStatus(
        wanted=len(chosen), ready=ready, nodes=sorted(n.name for n in chosen)[:256], message=message
    ).model_dump(exclude_none=True)


async def drop_pods(ctx: Context, namespace: str, pods: list[PodInfo], keep: set[str]) -> None:
    """Delete finished pre-stage pods that are no longer wanted (an older revision, a node
    no longer chosen, prestage removed); running ones finish first."""
    for p in pods:
        if p.name.startswith(POD_PREFIX) and p.name not in keep and p.finished:
            await ctx.api().delete_pod(namespace, p.name)
