"""Who uses which revision on which node, and what each node holds: pure logic.

The controller keeps read-only views (views.py; it never writes users' objects):
- consumer pods (labelled by the webhook) -> ``PodInfo`` by (namespace, cache);
- their owners (Job, JobSet, PyTorchJob, TrainJob, RayJob, RayCluster, Volcano
  Job) -> ``OwnerInfo`` by (namespace, uid).

``plan_nodes`` turns those plus the previous ``status.nodes`` into new node
entries and the (node, revision) copies to release now. It is level-based: it
depends only on current state, so a restarted operator reaches the same answer.

When a pod still holds a revision ("lifecycle by owner, not by pod phase"):
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

The wipe itself is safe on its own (leases under the stagers' lock): the
planning decides when it is worth trying and which leases to release.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from dscache_contract import STAGER_CONTAINER_NAME, RevisionRef, StageSummary

from .clock import fmt_time, parse_time
from .models import (
    CACHE_ANNOTATION,
    MODE_ANNOTATION,
    NodeRevision,
    NodeState,
    NodeStatus,
    PodPhase,
    Retention,
    RetentionPolicy,
    VolumeMode,
    parse_duration,
)

#: Stray leases recorded per (node, revision) are capped: status must stay small.
MAX_STRAY_LEASES = 200
#: How long a revision that a wipe found held by what it could not release
#: waits before the next wipe request, unless a lease it found can be released
#: by then. Without it a stray entry (a file someone left under leases/, which no
#: pod's end will ever release) sent a wipe every reconciliation.
KEPT_RETRY_S = 300.0

#: The pseudo-revision of a node's version 1 copy: the data that version 1 staged
#: straight into the top of C. Read only by pods without a revision annotation
#: (they mount C itself); removed by ``wipe --legacy``. Listed in
#: status.nodes[].revisions like a real revision (never an "r-" id), so it gets
#: the same consumers, lastUsed, retention and wipedAt bookkeeping.
LEGACY = "legacy"


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


class PodInfo(NamedTuple):
    name: str
    node: str | None
    phase: str
    owner: OwnerRef | None  # the controller ownerReference, if any
    mode: str  # HostPath | EmptyDir
    init: str | None  # None (not injected/seen), waiting, running, ok, failed
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
            init = "ok" if t.get("exitCode") == 0 else "failed"
            started, message, finished = t.get("startedAt"), t.get("message"), t.get("finishedAt")
        elif "running" in state:
            init, started = "running", state["running"].get("startedAt")
        else:
            init = "waiting"
            last = (cs.get("lastState") or {}).get("terminated")
            if last:  # restarting after a failure (restartPolicy OnFailure)
                init, started, message = "failed", last.get("startedAt"), last.get("message")
                finished = last.get("finishedAt")
    annotations = meta.get("annotations") or {}
    try:
        pinned = RevisionRef.from_annotations(annotations, annotations.get(CACHE_ANNOTATION, ""))
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
        phase=sys.intern(status.get("phase") or PodPhase.PENDING),
        owner=controller_ref(meta),
        mode=sys.intern(annotations.get(MODE_ANNOTATION, VolumeMode.HOST_PATH)),
        init=init,
        started=started,
        message=None if init == "ok" else (message or "").strip() or None,
        uid=meta.get("uid", ""),
        pinned=pinned,
        init_finished=finished,
        summary=StageSummary.from_message(message) if init == "ok" else None,
    )


def _intern(text: str | None) -> str | None:
    return sys.intern(text) if text else None


def pod_key(body: dict[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata") or {}
    cache = (meta.get("annotations") or {}).get(CACHE_ANNOTATION)
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


# --- helpers -------------------------------------------------------------------------------


# --- planning ------------------------------------------------------------------------------


class Release(NamedTuple):
    """One wipe step to take: remove ``revision`` (None: the whole cache dir, on
    deletion; LEGACY: the version 1 copy) on the node once the leases of ``release``
    are deleted."""

    revision: str | None
    release: tuple[str, ...]


class NodePlan(NamedTuple):
    entry: NodeStatus
    wipes: list[Release]
    relevant_since: datetime.datetime | None  # newest init start among relevant pods

    @property
    def wipe(self) -> bool:
        return bool(self.wipes)


def _started_after(pod: PodInfo, wiped_at: datetime.datetime | None) -> bool:
    started = parse_time(pod.started)
    if started is None:
        return False
    return wiped_at is None or started >= wiped_at


def _ttl_passed(last_used: str | None, retention: Retention, now: datetime.datetime) -> bool:
    if retention.policy == RetentionPolicy.WIPE_ON_JOB_COMPLETION:
        return True
    last = parse_time(last_used) or now
    return (now - last).total_seconds() >= parse_duration(retention.ttlAfterLastUse or "0s")


def plan_node(
    node: str,
    prior: NodeStatus | None,
    pods: Iterable[PodInfo],
    owners: OwnerLookup,
    retention: Retention,
    now: datetime.datetime,
    deleting: bool = False,
    blocked_everywhere: frozenset[str] = frozenset(),
    block_all: bool = False,
    keep_wiped: float = 3600.0,
    live_anywhere: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
) -> NodePlan | None:
    """``keep``: revisions pre-staged onto this node (spec.prestage), never wiped while so;
    ``blocked_everywhere``: revisions of unscheduled live pods (they may land here);
    ``block_all``: an unscheduled live pod of unknown revision exists;
    ``live_anywhere``: UIDs of every pod of the cache that still holds its revision.

    Which leases a wipe releases: those of this node's pods that no longer hold
    the revision, plus the stray leases an earlier wipe reported that still belong
    to no holding pod. A lease is written by a running stager, whose pod carries
    our label from admission on, so the pod view shows it within the watch lag; a
    UID still unknown one reconciliation after a wipe reported it is a pod deleted
    meanwhile (e.g. while the operator was down), and keeping its lease would keep
    the revision forever."""
    pods = list(pods)
    wiped_at = parse_time(prior.wipedAt) if prior is not None else None
    consumers = [p for p in pods if holds(p, owners, deleting)]
    relevant = [p for p in pods if p in consumers or _started_after(p, wiped_at)]
    if prior is None and not relevant:
        return None  # only old, finished pods: nothing of theirs is on the node any more
    entry = prior.model_copy(deep=True) if prior is not None else NodeStatus(node=node, state=NodeState.STAGING)

    if relevant:
        entry.volume = (
            VolumeMode.HOST_PATH if any(p.mode == VolumeMode.HOST_PATH for p in relevant) else VolumeMode.EMPTY_DIR
        )
        # Ready means: what the live consumers hold is on disk. So while any
        # consumer's stager has not finished (it may be re-staging a revision a
        # wipe just removed), the node is Staging, even if older pods were Ready.
        pending = [p for p in consumers if p.init in (None, "waiting", "running")]
        basis = consumers if consumers else relevant
        ok = [p for p in basis if p.init == "ok"]
        failed = [p for p in basis if p.init == "failed"]
        if pending:
            entry.state, entry.message = NodeState.STAGING, None
        elif ok:
            best = max(ok, key=lambda p: p.started or "")
            entry.state, entry.message = NodeState.READY, None
            if best.summary is not None:
                s = best.summary
                entry.bytes, entry.objects, entry.seconds = s.bytes, s.objects, s.seconds
                entry.bucketBytes, entry.peerBytes = s.bucket_bytes, s.peer_bytes
        elif failed:
            last = max(failed, key=lambda p: p.started or "")
            entry.state = NodeState.FAILED
            entry.message = (last.message or "the stager failed; see kubectl logs -c " + STAGER_CONTAINER_NAME)[:4096]

    if len(consumers) != entry.consumers or (prior is None and relevant):
        entry.lastUsed = fmt_time(now)
    entry.consumers = len(consumers)

    # Revisions on the node, and the pods that have (had) a lease on each.
    # A wiped revision stays listed (wipedAt) for keep_wiped, so that the finished
    # pods that used it do not bring it back; a pod holding it, or one that
    # started staging it after the wipe, does.
    revs: dict[str, NodeRevision] = {}
    for r in entry.revisions:
        wiped = parse_time(r.wipedAt)
        if wiped is None or (now - wiped).total_seconds() <= keep_wiped:
            revs[r.id] = r.model_copy(deep=True)
    if (
        prior is not None
        and not prior.revisions
        and prior.volume == VolumeMode.HOST_PATH
        and prior.state != NodeState.WIPED
    ):
        # An entry written before revisions existed: its node holds a version 1 copy.
        revs[LEGACY] = NodeRevision(id=LEGACY, lastUsed=prior.lastUsed or fmt_time(now))
    for p in relevant:
        if p.mode != VolumeMode.HOST_PATH:
            continue
        rid = p.revision or LEGACY  # a pod without a revision staged (and reads) the version 1 copy
        known = revs.get(rid)
        if known is None:
            revs[rid] = NodeRevision(id=rid, lastUsed=fmt_time(now))
        elif known.wipedAt is not None:
            if p not in consumers and not _started_after(p, parse_time(known.wipedAt)):
                continue
            known.wipedAt, known.strayLeases, known.lastUsed, known.keptAt = None, [], fmt_time(now), None
    for r in revs.values():
        n = sum(1 for p in consumers if (p.revision or LEGACY) == r.id)
        if n != r.consumers:
            r.consumers, r.lastUsed, r.keptAt = n, fmt_time(now), None
    entry.revisions = [revs[k] for k in sorted(revs)]
    active = [r for r in entry.revisions if r.wipedAt is None]

    wipes: list[Release] = []
    holds_copy = entry.state != NodeState.WIPED and (prior is not None or bool(relevant))
    done_here = [p for p in pods if p not in consumers]
    if entry.volume == VolumeMode.EMPTY_DIR:
        if holds_copy and not consumers and (deleting or _ttl_passed(entry.lastUsed, retention, now)):
            # The kubelet removes emptyDir volumes with their pods: nothing of ours remains.
            entry.state, entry.wipedAt, entry.revisions = NodeState.WIPED, fmt_time(now), []
    elif block_all or not holds_copy:
        pass  # an unscheduled pod of unknown revision may land here: keep everything
    elif deleting:
        # A whole-cache wipe that was kept marked every revision (controller.py).
        kept = [r for r in entry.revisions if r.keptAt]
        waits = bool(kept) and all(_kept_waits(r, live_anywhere, now) for r in kept)
        if not consumers and not blocked_everywhere and not waits:
            # One wipe removes C itself once no lease at all remains.
            release = {p.uid for p in done_here if p.uid}
            for r in active:
                release.update(u for u in r.strayLeases if u not in live_anywhere)
            wipes.append(Release(None, tuple(sorted(release))))
    else:
        # A pod without a revision annotation mounts C itself, so it sees every
        # revision and the version 1 copy: while one holds here, nothing is removed.
        legacy_holders = any(not p.revision for p in consumers)
        for r in active:
            if r.consumers or legacy_holders or r.id in blocked_everywhere or r.id in keep:
                continue
            if not _ttl_passed(r.lastUsed, retention, now) or _kept_waits(r, live_anywhere, now):
                continue
            if r.id == LEGACY:
                # Why no reader of the version 1 copy ever sees its files vanish:
                # only a pod admitted without a revision annotation reads it (it
                # mounts C; every other container mounts revs/<rev>/data). We get
                # here only when no such pod holds on this node (legacy_holders)
                # and none is unscheduled anywhere (block_all, above), judged on
                # complete views (the controller waits for them). This webhook
                # never admits a pod without a revision (webhook.no_revision), so
                # once every webhook replica runs it that set only shrinks and the
                # condition stays true. What is left is a rolling upgrade, where an
                # old replica may admit such a pod that our view does not show yet;
                # the agent's wipe closes that on disk (dscache_stager.wipe): while its
                # stager stages it holds version 1's lock (the wipe is busy), once
                # it finished the copy changed less than LEGACY_QUIET_S ago (busy
                # too), and before it starts its pod reads nothing and it stages a
                # fresh copy. Either way the next plan sees the pod and waits.
                # No leases to release: version 1 wrote none.
                wipes.append(Release(LEGACY, ()))
                continue
            release = {p.uid for p in done_here if p.uid and p.revision == r.id}
            release.update(u for u in r.strayLeases if u not in live_anywhere)
            wipes.append(Release(r.id, tuple(sorted(release))))
        if not active and not consumers and prior is not None and entry.state != NodeState.WIPED:
            # Nothing of any revision left here (a version 1 copy is LEGACY, active until wiped).
            entry.state, entry.wipedAt = NodeState.WIPED, fmt_time(now)
    return NodePlan(entry, wipes, _newest(relevant))


def _kept_waits(r: NodeRevision, live_anywhere: frozenset[str], now: datetime.datetime) -> bool:
    """Whether the next wipe of ``r`` waits: a wipe found it held (keptAt) less than
    KEPT_RETRY_S ago, and none of the leases it found can be released now."""
    kept = parse_time(r.keptAt)
    if kept is None or (now - kept).total_seconds() >= KEPT_RETRY_S:
        return False
    return not any(u not in live_anywhere for u in r.strayLeases)


def _newest(pods: Iterable[PodInfo]) -> datetime.datetime | None:
    times = [t for t in (parse_time(p.started) for p in pods) if t is not None]
    return max(times, default=None)


def plan_nodes(
    prior: list[NodeStatus],
    pods: Iterable[PodInfo],
    owners: OwnerLookup,
    retention: Retention,
    now: datetime.datetime,
    deleting: bool = False,
    keep_wiped: float = 3600.0,
    gone_nodes: frozenset[str] = frozenset(),
    keep: dict[str, frozenset[str]] | None = None,
) -> dict[str, NodePlan]:
    """``gone_nodes``: nodes the API server says no longer exist. They are dropped
    from status and get no wipe (their disks went with them). ``keep``: per node, the
    revisions pre-staged there (see plan_node)."""
    pods = list(pods)
    by_node: dict[str, list[PodInfo]] = {}
    blocked: set[str] = set()
    block_all = False
    for p in pods:
        if p.node:
            by_node.setdefault(p.node, []).append(p)
        elif not p.finished and p.mode == VolumeMode.HOST_PATH:
            # Not scheduled yet: it may land on any node, so its revision stays everywhere.
            if p.revision:
                blocked.add(p.revision)
            else:
                block_all = True
    live = frozenset(p.uid for p in pods if p.uid and holds(p, owners, deleting))
    prior_by_node = {n.node: n for n in prior}
    plans = {}
    for node in sorted(set(by_node) | set(prior_by_node)):
        if node in gone_nodes:
            continue
        old = prior_by_node.get(node)
        if old is not None and node not in by_node and old.state == NodeState.WIPED:
            wiped = parse_time(old.wipedAt)
            if wiped is None or (now - wiped).total_seconds() > keep_wiped:
                continue  # keep status bounded: forget long-wiped nodes no pod refers to
        plan = plan_node(
            node,
            old,
            by_node.get(node, []),
            owners,
            retention,
            now,
            deleting,
            frozenset(blocked),
            block_all,
            keep_wiped,
            live,
            (keep or {}).get(node, frozenset()),
        )
        if plan is not None:
            plans[node] = plan
    return plans
