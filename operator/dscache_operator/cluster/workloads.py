"""Who uses which revision: consumer pods and their owners, as the controller sees them (pure).

The controller keeps read-only views (views.py; it never writes users' objects):
- consumer pods (labelled by the webhook) -> ``PodInfo`` by (namespace, cache);
- their owners (Job, JobSet, PyTorchJob, TrainJob, RayJob, RayCluster, Volcano
  Job) -> ``OwnerInfo`` by (namespace, uid).

When a pod still holds a revision (``holds``: "lifecycle by owner, not by pod phase"):
- a pod that is not finished holds it; without a node yet (unscheduled), it
  holds it on EVERY node, so no wipe can race its start (issue 7, point 3);
- a finished pod holds it while its top-level owner (followed through
  ownerReferences) is known and not finished: a running PyTorchJob may recreate
  a worker on that node, and that must not trigger a wipe;
- owners of unknown kinds (a ReplicaSet, a CRD we do not know, or a kind whose
  CRD is not installed) fall back to the pod's own phase: finished = released.
  An owner that is gone from the cluster has finished.
- while the DatasetCache is being deleted, only unfinished pods hold: the
  webhook refuses new pods of a deleting cache, so an owner that "may start
  another pod" never will, and waiting for it would deadlock the deletion.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from dscache_contract import ANNOTATION_CACHE, STAGER_CONTAINER_NAME, RevisionRef, StageSummary

from ..api.models import MODE_ANNOTATION, PodPhase, VolumeMode


class OwnerRef(NamedTuple):
    kind: str
    name: str
    uid: str


class OwnerInfo(NamedTuple):
    """One owner object: whether it finished, and its own controller owner."""

    kind: str
    name: str
    finished: bool | None  # None: this kind has no finished state (e.g. RayCluster)
    owner: OwnerRef | None


class InitState(enum.StrEnum):
    """What a pod's stager (its dscache-stage init container) is doing, as its status says."""

    WAITING = "waiting"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"


class PodInfo(NamedTuple):
    name: str
    node: str | None
    phase: str
    owner: OwnerRef | None  # the controller ownerReference, if any
    mode: str  # HostPath | EmptyDir
    init: InitState | None  # None: not injected, or not seen yet
    started: str | None  # init container start (RFC 3339)
    message: str | None  # a failed stager's termination message (a successful one's is parsed into summary)
    uid: str = ""
    pinned: RevisionRef | None = None  # the revision it was admitted with (None: none, or unreadable)
    init_finished: str | None = None  # when the init container terminated (RFC 3339; metrics count runs by it)
    summary: StageSummary | None = None  # a successful stager's summary, parsed once here

    @property
    def finished(self) -> bool:
        return self.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED)

    @property
    def revision(self) -> str | None:
        """The pinned revision's id: what a node holds and a wipe removes."""
        return self.pinned.id if self.pinned is not None else None


def controller_ref(meta: dict[str, Any]) -> OwnerRef | None:
    refs = meta.get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if not ref or not ref.get("uid"):
        return None
    return OwnerRef(ref.get("kind", ""), ref.get("name", ""), ref["uid"])


def pod_info(body: dict[str, Any]) -> PodInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    init = started = message = finished = None
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") != STAGER_CONTAINER_NAME:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            init = InitState.OK if t.get("exitCode") == 0 else InitState.FAILED
            started, message, finished = t.get("startedAt"), t.get("message"), t.get("finishedAt")
        elif "running" in state:
            init, started = InitState.RUNNING, state["running"].get("startedAt")
        else:
            init = InitState.WAITING
            last = (cs.get("lastState") or {}).get("terminated")
            if last:  # restarting after a failure (restartPolicy OnFailure)
                init, started, message = InitState.FAILED, last.get("startedAt"), last.get("message")
                finished = last.get("finishedAt")
    annotations = meta.get("annotations") or {}
    try:
        pinned = RevisionRef.from_annotations(annotations, annotations.get(ANNOTATION_CACHE, ""))
    except ValueError:
        # Admission refuses malformed revision annotations, so only a hand edit
        # after admission gets here. Counted as no revision: such a pod holds every
        # revision on its node (and, unscheduled, everywhere), the safe side for
        # wipes, and it gives its owner no pin.
        pinned = None
    # 50,000 pods name a few dozen nodes, phases and modes: one string each, shared.
    return PodInfo(
        name=meta.get("name", ""),
        node=_intern(spec.get("nodeName")),
        phase=sys.intern(status.get("phase") or PodPhase.PENDING.value),
        owner=controller_ref(meta),
        mode=sys.intern(annotations.get(MODE_ANNOTATION, VolumeMode.HOST_PATH.value)),
        init=init,
        started=started,
        message=None if init == InitState.OK else (message or "").strip() or None,
        uid=meta.get("uid", ""),
        pinned=pinned,
        init_finished=finished,
        summary=StageSummary.from_message(message) if init == InitState.OK else None,
    )


def _intern(text: str | None) -> str | None:
    return sys.intern(text) if text else None


def pod_key(body: dict[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata") or {}
    cache = (meta.get("annotations") or {}).get(ANNOTATION_CACHE)
    if not cache:
        return None
    return (sys.intern(meta.get("namespace", "")), sys.intern(cache))


# --- owners: each kind's "finished" -------------------------------------------------------


def _condition_true(body: dict[str, Any], types: tuple[str, ...]) -> bool:
    return any(
        c.get("type") in types and c.get("status") == "True" for c in (body.get("status") or {}).get("conditions") or []
    )


def job_finished(body: dict[str, Any]) -> bool:
    return _condition_true(body, ("Complete", "Failed"))


def _rayjob_finished(body: dict[str, Any]) -> bool:
    status = body.get("status") or {}
    return status.get("jobDeploymentStatus") in ("Complete", "Failed") or status.get("jobStatus") in (
        "SUCCEEDED",
        "FAILED",
        "STOPPED",
    )


def _volcano_finished(body: dict[str, Any]) -> bool:
    phase = ((body.get("status") or {}).get("state") or {}).get("phase")
    return phase in ("Completed", "Failed", "Terminated", "Aborted")


class OwnerKind(NamedTuple):
    kind: str
    group_path: str  # /apis/<group>/<version>
    plural: str
    finished: Callable[[dict[str, Any]], bool] | None  # None: never finishes by itself


#: The owner kinds whose finished condition we know. Their CRDs are optional:
#: an absent one is simply an empty view (see informer.py).
OWNER_KINDS: tuple[OwnerKind, ...] = (
    OwnerKind("Job", "/apis/batch/v1", "jobs", job_finished),
    OwnerKind(
        "JobSet", "/apis/jobset.x-k8s.io/v1alpha2", "jobsets", lambda b: _condition_true(b, ("Completed", "Failed"))
    ),
    OwnerKind(
        "PyTorchJob", "/apis/kubeflow.org/v1", "pytorchjobs", lambda b: _condition_true(b, ("Succeeded", "Failed"))
    ),
    OwnerKind(
        "TrainJob",
        "/apis/trainer.kubeflow.org/v1alpha1",
        "trainjobs",
        lambda b: _condition_true(b, ("Complete", "Failed")),
    ),
    OwnerKind("RayJob", "/apis/ray.io/v1", "rayjobs", _rayjob_finished),
    OwnerKind("RayCluster", "/apis/ray.io/v1", "rayclusters", None),
    OwnerKind("Job.batch.volcano.sh", "/apis/batch.volcano.sh/v1alpha1", "jobs", _volcano_finished),
)


def owner_info(kind: OwnerKind, body: dict[str, Any]) -> OwnerInfo:
    meta = body.get("metadata") or {}
    finished = kind.finished(body) if kind.finished is not None else None
    return OwnerInfo(kind.kind, meta.get("name", ""), finished, controller_ref(meta))


OwnerLookup = Callable[[str], "OwnerInfo | None"]  # uid -> info (None: not in any view)


def top_owner(pod: PodInfo, owners: OwnerLookup) -> tuple[OwnerRef | None, OwnerInfo | None]:
    """Follow controller ownerReferences up as far as our views know them."""
    ref, info = pod.owner, None
    seen = set()
    while ref is not None and ref.uid not in seen:
        seen.add(ref.uid)
        got = owners(ref.uid)
        if got is None:
            break
        info = got
        if got.owner is None or owners(got.owner.uid) is None:
            break
        ref = got.owner
    return ref, info


def holds(pod: PodInfo, owners: OwnerLookup, deleting: bool = False) -> bool:
    """The pod still holds (or may hold again) its revision. See the module docstring."""
    if not pod.finished:
        return True
    if deleting or pod.owner is None:
        return False
    _ref, info = top_owner(pod, owners)
    if info is None:
        return False  # unknown kind, or an owner already gone: pod phase decides
    if info.finished is None:  # a kind that never finishes by itself (RayCluster): alive while it exists
        return True
    return not info.finished
