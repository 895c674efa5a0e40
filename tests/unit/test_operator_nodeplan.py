"""Consumer tracking and per-node plans (pure, level-based logic)."""

from __future__ import annotations

import datetime

from dscache_contract import RevisionRef, StageSummary
from dscache_operator.api.models import NodeRevision, NodeStatus, Retention
from dscache_operator.cluster.workloads import (
    OwnerInfo,
    OwnerRef,
    PodInfo,
    job_finished,
    pod_info,
)
from dscache_operator.control import nodeplan as wipe
from dscache_operator.control.nodeplan import LEGACY, plan_nodes
from dscache_operator.settings import Settings

NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
WIPE = Retention()
S = Settings(cache_root="/mnt/nvme/dscache", namespace="dscache-system", stager_image="stager:t")
SUMMARY = '{"objects": 3, "bytes": 300, "skipped": 0, "fetched_bytes": 300, "seconds": 1.5, "mb_s": 0.2}'


REV = "r-0123456789abcdef0123"
REV2 = "r-fedcba9876543210fedc"


def pod(
    name="p",
    node="n1",
    phase="Running",
    job="train",
    init="ok",
    started="2026-11-21T11:00:00Z",
    message=SUMMARY,
    mode="HostPath",
    revision=REV,
    kind="Job",
    uid=None,
):
    owner = OwnerRef(kind, job, f"uid-{job}") if job else None
    pinned = RevisionRef(revision) if revision else None
    summary = StageSummary.from_message(message) if init == "ok" else None
    message = None if init == "ok" else message
    return PodInfo(
        name, node, phase, owner, mode, init, started, message, uid or f"uid-{name}", pinned, summary=summary
    )


def jobs(**state):
    """Owner lookup: Job name -> finished (None: not in any view)."""

    def lookup(uid):
        name = uid[len("uid-") :]
        if name not in state or state[name] is None:
            return None
        return OwnerInfo("Job", name, state[name], None)

    return lookup


def node(name="n1", state="Ready", revisions=(REV,), **kw):
    return NodeStatus(node=name, state=state, revisions=[NodeRevision(id=r) for r in revisions], **kw)


def test_pod_info_reads_init_status_and_owner():
    body = {
        "metadata": {
            "name": "p",
            "namespace": "ml",
            "annotations": {"dscache.io/cache": "c", "dscache.io/volume": "HostPath"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train"}],
        },
        "spec": {"nodeName": "gpu-1"},
        "status": {
            "phase": "Running",
            "initContainerStatuses": [
                {
                    "name": "dscache-stage",
                    "state": {"terminated": {"exitCode": 0, "startedAt": "2026-11-21T11:00:00Z", "message": SUMMARY}},
                }
            ],
        },
    }
    body["metadata"]["ownerReferences"][0].update(uid="u1", controller=True)
    body["metadata"]["annotations"]["dscache.io/revision"] = REV
    info = pod_info(body)
    assert (info.node, info.owner, info.init, info.mode, info.revision) == (
        "gpu-1",
        OwnerRef("Job", "train", "u1"),
        "ok",
        "HostPath",
        REV,
    )
    # Parsed once, typed; the raw message is kept only for failures.
    assert info.summary is not None and (info.summary.bytes, info.summary.seconds) == (300, 1.5)
    assert (info.summary.bucket_bytes, info.summary.peer_bytes) == (0, 0)  # an older stager's summary
    assert info.message is None


def test_job_finished():
    assert job_finished({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    assert job_finished({"status": {"conditions": [{"type": "Failed", "status": "True"}]}})
    assert not job_finished({"status": {"conditions": [{"type": "Suspended", "status": "True"}]}})
    assert not job_finished({})


def test_running_consumer_makes_ready_node_without_wipe():
    plans = plan_nodes([], [pod()], jobs(train=False), WIPE, NOW)
    p = plans["n1"]
    assert p.entry.state == "Ready" and p.entry.bytes == 300 and p.entry.seconds == 1.5
    assert p.entry.consumers == 1 and not p.wipes


def test_staging_and_failed_states():
    assert (
        plan_nodes([], [pod(init="running", message=None)], jobs(train=False), WIPE, NOW)["n1"].entry.state == "Staging"
    )
    failed = plan_nodes(
        [], [pod(phase="Failed", init="failed", message="error: bucket gone")], jobs(train=False), WIPE, NOW
    )["n1"]
    assert failed.entry.state == "Failed" and "bucket gone" in failed.entry.message


def test_completed_job_wipes_node():
    prior = [node(consumers=1)]
    p = plan_nodes(prior, [pod(phase="Succeeded")], jobs(train=True), WIPE, NOW)["n1"]
    assert p.wipes and p.entry.consumers == 0
    (step,) = p.wipes
    assert step.revision == REV and step.release == ("uid-p",)


def test_finished_pod_of_running_job_still_consumes():
    p = plan_nodes([], [pod(phase="Succeeded")], jobs(train=False), WIPE, NOW)["n1"]
    assert not p.wipes and p.entry.consumers == 1


def test_other_live_consumer_on_node_prevents_wipe():
    pods = [pod(phase="Succeeded", job="a"), pod(name="q", job="b")]
    p = plan_nodes([], pods, jobs(a=True, b=False), WIPE, NOW)["n1"]
    assert not p.wipes and p.entry.consumers == 1


def test_each_node_decided_separately():
    pods = [pod(node="n1", phase="Succeeded", job="a"), pod(name="q", node="n2", job="b")]
    plans = plan_nodes([], pods, jobs(a=True, b=False), WIPE, NOW)
    assert plans["n1"].wipes and not plans["n2"].wipes


def test_retain_while_used_waits_for_ttl():
    keep = Retention(policy="RetainWhileUsed", ttlAfterLastUse="1h")
    recent = [
        NodeStatus(
            node="n1", state="Ready", consumers=0, revisions=[NodeRevision(id=REV, lastUsed="2026-11-21T11:30:00Z")]
        )
    ]
    assert not plan_nodes(recent, [pod(phase="Succeeded")], jobs(train=True), keep, NOW)["n1"].wipes
    old = [
        NodeStatus(
            node="n1", state="Ready", consumers=0, revisions=[NodeRevision(id=REV, lastUsed="2026-11-21T10:30:00Z")]
        )
    ]
    assert plan_nodes(old, [pod(phase="Succeeded")], jobs(train=True), keep, NOW)["n1"].wipes


def test_wiped_node_stays_wiped_for_old_pods_and_restages_for_new_ones():
    prior = [NodeStatus(node="n1", state="Wiped", wipedAt="2026-11-21T11:30:00Z", bytes=300)]
    old = pod(phase="Succeeded", started="2026-11-21T11:00:00Z", revision=None)
    p = plan_nodes(prior, [old], jobs(train=True), WIPE, NOW)["n1"]
    assert p.entry.state == "Wiped" and not p.wipes
    new = pod(name="q", job="t2", init="running", message=None, started="2026-11-21T11:45:00Z")
    p = plan_nodes(prior, [old, new], jobs(train=True, t2=False), WIPE, NOW)["n1"]
    assert p.entry.state == "Staging" and not p.wipes


def test_emptydir_copies_need_no_helper():
    prior = [NodeStatus(node="n1", state="Ready", volume="EmptyDir", consumers=1)]
    p = plan_nodes(prior, [pod(phase="Succeeded", mode="EmptyDir")], jobs(train=True), WIPE, NOW)["n1"]
    assert p.entry.state == "Wiped" and not p.wipes


def test_unscheduled_and_stale_pods_create_no_entries():
    plans = plan_nodes(
        [], [pod(node=None), pod(name="old", phase="Succeeded", init=None, started=None)], jobs(train=True), WIPE, NOW
    )
    assert plans == {}


def test_deletion_wipes_even_retained_copies():
    keep = Retention(policy="RetainWhileUsed", ttlAfterLastUse="30d")
    prior = [node(consumers=0, lastUsed="2026-11-21T11:59:00Z")]
    p = plan_nodes(prior, [], jobs(), keep, NOW, deleting=True)["n1"]
    assert [s.revision for s in p.wipes] == [None]  # --all: C itself, once no lease remains


def test_long_wiped_nodes_without_pods_are_forgotten():
    recent = NodeStatus(node="n1", state="Wiped", wipedAt="2026-11-21T11:30:00Z")
    old = NodeStatus(node="n2", state="Wiped", wipedAt="2026-11-21T09:00:00Z")
    old_with_pod = NodeStatus(node="n3", state="Wiped", wipedAt="2026-11-21T09:00:00Z")
    plans = plan_nodes(
        [recent, old, old_with_pod],
        [pod(node="n3", phase="Succeeded", started="2026-11-21T08:00:00Z")],
        jobs(train=True),
        WIPE,
        NOW,
    )
    assert sorted(plans) == ["n1", "n3"]
    assert not plans["n3"].wipes and plans["n3"].entry.state == "Wiped"


# --- issue 7: revisions, leases, owners -------------------------------------------------------


def owners(**infos):
    """uid -> OwnerInfo."""
    return lambda uid: infos.get(uid)


def test_each_revision_is_released_apart_and_only_when_no_pod_holds_it():
    # Job a (REV) finished; Job b (REV2) still runs on the same node.
    prior = [node(revisions=(REV, REV2), consumers=2)]
    pods = [pod("a-0", job="a", phase="Succeeded", revision=REV), pod("b-0", job="b", revision=REV2)]
    p = plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)["n1"]
    assert [(s.revision, s.release) for s in p.wipes] == [(REV, ("uid-a-0",))]
    assert [r.id for r in p.entry.revisions] == [REV, REV2]


def test_unscheduled_pod_blocks_its_revision_on_every_node():
    """The wipe race of issue 7 (3): the next consumer is still Pending."""
    prior = [node("n1", consumers=1), node("n2", consumers=1)]
    pods = [
        pod("a-0", node="n1", job="a", phase="Succeeded"),
        pod("a-1", node="n2", job="a", phase="Succeeded"),
        pod("b-0", node=None, job="b", phase="Pending", init=None, started=None, message=None),
    ]
    plans = plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)
    assert not plans["n1"].wipes and not plans["n2"].wipes
    # A pending pod of another revision blocks only that revision.
    pods[-1] = pods[-1]._replace(pinned=RevisionRef(REV2))
    plans = plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)
    assert plans["n1"].wipes and plans["n2"].wipes


def test_pytorchjob_recreating_a_worker_does_not_trigger_a_wipe():
    pt = OwnerInfo("PyTorchJob", "pt", False, None)
    failed_worker = pod("pt-worker-0", job="pt", kind="PyTorchJob", phase="Failed", init="ok")
    plans = plan_nodes([node(consumers=1)], [failed_worker], owners(**{"uid-pt": pt}), WIPE, NOW)
    assert not plans["n1"].wipes and plans["n1"].entry.consumers == 1
    done = owners(**{"uid-pt": pt._replace(finished=True)})
    assert plan_nodes([node(consumers=1)], [failed_worker], done, WIPE, NOW)["n1"].wipes


def test_jobset_pods_are_judged_by_the_jobset_not_their_job():
    # Pod -> Job (finished) -> JobSet (running): still held.
    job_ = OwnerInfo("Job", "js-w-0", True, OwnerRef("JobSet", "js", "uid-js"))
    js = OwnerInfo("JobSet", "js", False, None)
    p0 = pod("js-w-0-0", job="js-w-0", phase="Succeeded")
    view = owners(**{"uid-js-w-0": job_, "uid-js": js})
    assert not plan_nodes([node(consumers=1)], [p0], view, WIPE, NOW)["n1"].wipes
    view = owners(**{"uid-js-w-0": job_, "uid-js": js._replace(finished=True)})
    assert plan_nodes([node(consumers=1)], [p0], view, WIPE, NOW)["n1"].wipes


def test_unknown_owner_kinds_fall_back_to_pod_phase():
    rs_pod = pod("web-1", job="web", kind="ReplicaSet", phase="Running")
    assert not plan_nodes([node(consumers=1)], [rs_pod], owners(), WIPE, NOW)["n1"].wipes
    assert plan_nodes([node(consumers=1)], [rs_pod._replace(phase="Succeeded")], owners(), WIPE, NOW)["n1"].wipes


def test_raycluster_holds_while_it_exists_and_rayjob_decides_above_it():
    rc = OwnerInfo("RayCluster", "rc", None, None)
    p0 = pod("rc-worker", job="rc", kind="RayCluster", phase="Succeeded")
    assert not plan_nodes([node(consumers=1)], [p0], owners(**{"uid-rc": rc}), WIPE, NOW)["n1"].wipes
    rc_owned = rc._replace(owner=OwnerRef("RayJob", "rj", "uid-rj"))
    rj_done = OwnerInfo("RayJob", "rj", True, None)
    assert plan_nodes([node(consumers=1)], [p0], owners(**{"uid-rc": rc_owned, "uid-rj": rj_done}), WIPE, NOW)[
        "n1"
    ].wipes


def test_owner_finished_conditions_per_kind():
    from dscache_operator.cluster.workloads import OWNER_KINDS, owner_info

    kinds = {k.kind: k for k in OWNER_KINDS}

    def cond(t):
        return {"metadata": {"name": "x"}, "status": {"conditions": [{"type": t, "status": "True"}]}}

    assert owner_info(kinds["JobSet"], cond("Completed")).finished
    assert owner_info(kinds["PyTorchJob"], cond("Succeeded")).finished
    assert not owner_info(kinds["PyTorchJob"], cond("Running")).finished
    assert owner_info(kinds["TrainJob"], cond("Complete")).finished
    assert owner_info(kinds["RayJob"], {"status": {"jobDeploymentStatus": "Complete"}}).finished
    assert not owner_info(kinds["RayJob"], {"status": {"jobDeploymentStatus": "Running"}}).finished
    assert owner_info(kinds["Job.batch.volcano.sh"], {"status": {"state": {"phase": "Completed"}}}).finished
    assert owner_info(kinds["RayCluster"], {}).finished is None


def test_deletion_while_a_job_still_needs_pods_does_not_deadlock():
    """A running Job whose finished pod is on the node: normally that pod still
    holds the copy (the Job may start another pod). While the cache is being
    deleted the webhook refuses new pods, so it must not hold it any longer."""
    prior = [node(consumers=1)]
    pods = [pod("t-0", phase="Failed")]
    assert not plan_nodes(prior, pods, jobs(train=False), WIPE, NOW)["n1"].wipes
    p = plan_nodes(prior, pods, jobs(train=False), WIPE, NOW, deleting=True)["n1"]
    assert p.entry.consumers == 0 and [(s.revision, s.release) for s in p.wipes] == [(None, ("uid-t-0",))]
    # A pod still running keeps deletion waiting (its mount source must stay).
    p = plan_nodes(prior, [pod("t-1")], jobs(train=False), WIPE, NOW, deleting=True)["n1"]
    assert not p.wipes and p.entry.consumers == 1


def test_stray_leases_are_released_unless_a_live_pod_owns_them():
    """A wipe reported leases of pods the view does not show (deleted while the operator
    was down): the next wipe releases them, but never one of a pod that still holds."""
    prior = [
        NodeStatus(
            node="n1",
            state="Ready",
            consumers=1,
            revisions=[NodeRevision(id=REV, consumers=1, strayLeases=["uid-gone", "uid-q"])],
        )
    ]
    pods = [pod(phase="Succeeded"), pod("q", node="n2", job="other")]  # q holds REV on n2
    p = plan_nodes(prior, pods, jobs(train=True, other=False), WIPE, NOW)["n1"]
    (step,) = p.wipes
    assert step.release == ("uid-gone", "uid-p")


def _kept(kept_ago: float, stray: list[str], consumers: int = 0) -> list[NodeStatus]:
    """Node n1 whose REV a wipe found held ``kept_ago`` seconds before NOW."""
    kept_at = (NOW - datetime.timedelta(seconds=kept_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    rev = NodeRevision(id=REV, consumers=consumers, lastUsed="2026-11-21T11:00:00Z", keptAt=kept_at, strayLeases=stray)
    return [NodeStatus(node="n1", state="Ready", consumers=consumers, revisions=[rev])]


def test_a_revision_kept_by_nothing_releasable_waits_before_the_next_helper():
    """A wipe found REV held by an entry that is no lease (or by the lease of a pod that
    still holds REV elsewhere): a new helper would find the same, so none starts for
    KEPT_RETRY_S (it started one every reconciliation); then it tries again."""
    from dscache_operator.control.nodeplan import KEPT_RETRY_S

    done = [pod(phase="Succeeded")]
    live_q = [*done, pod("q", node="n2", job="other")]  # q holds REV on n2
    for stray, pods in (([], done), (["uid-q"], live_q)):
        owners = jobs(train=True, other=False)
        assert not plan_nodes(_kept(60, stray), pods, owners, WIPE, NOW)["n1"].wipes
        (step,) = plan_nodes(_kept(KEPT_RETRY_S + 1, stray), pods, owners, WIPE, NOW)["n1"].wipes
        assert step.revision == REV


def test_a_kept_revision_with_a_releasable_lease_is_wiped_again_at_once():
    (step,) = plan_nodes(_kept(1, ["uid-gone"]), [pod(phase="Succeeded")], jobs(train=True), WIPE, NOW)["n1"].wipes
    assert step.release == ("uid-gone", "uid-p")


def test_a_new_consumer_clears_the_kept_mark():
    plan = plan_nodes(_kept(1, []), [pod()], jobs(train=False), WIPE, NOW)["n1"]
    assert plan.entry.revisions[0].consumers == 1
    assert plan.entry.revisions[0].keptAt is None


def test_a_kept_whole_cache_wipe_on_deletion_waits_too():
    from dscache_operator.control.nodeplan import KEPT_RETRY_S

    done = [pod(phase="Succeeded")]
    assert not plan_nodes(_kept(60, []), done, jobs(train=True), WIPE, NOW, deleting=True)["n1"].wipes
    (step,) = plan_nodes(_kept(KEPT_RETRY_S + 1, []), done, jobs(train=True), WIPE, NOW, deleting=True)["n1"].wipes
    assert step.revision is None


def test_a_wiped_revision_is_not_wiped_again_for_finished_pods_but_comes_back_for_new_ones():
    """Node n1 keeps serving REV2 while REV was wiped: REV's finished pods must
    not bring it back (that would start a helper every reconciliation)."""
    prior = [
        NodeStatus(
            node="n1",
            state="Ready",
            consumers=1,
            revisions=[NodeRevision(id=REV, wipedAt="2026-11-21T11:50:00Z"), NodeRevision(id=REV2, consumers=1)],
        )
    ]
    pods = [
        pod("a-0", job="a", phase="Succeeded", revision=REV, started="2026-11-21T11:00:00Z"),
        pod("b-0", job="b", revision=REV2),
    ]
    p = plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)["n1"]
    assert not p.wipes and p.entry.state == "Ready"
    assert [(r.id, r.wipedAt is not None) for r in p.entry.revisions] == [(REV, True), (REV2, False)]
    # A new pod of REV starts staging there after the wipe: REV is live again.
    pods.append(pod("c-0", job="c", revision=REV, init="running", started="2026-11-21T11:55:00Z", message=None))
    p = plan_nodes(prior, pods, jobs(a=True, b=False, c=False), WIPE, NOW)["n1"]
    assert next((r.id, r.wipedAt) for r in p.entry.revisions) == (REV, None)


def test_node_is_not_ready_while_a_consumer_is_still_staging():
    """test_wipe_race: Job 1's pods were Ready; the wipe may have just removed the copy
    that Job 2's pod (stager not finished) now holds: the node must say Staging."""
    prior = [node(consumers=0)]
    pods = [
        pod("a-0", job="a", phase="Succeeded"),
        pod("b-0", job="b", phase="Pending", init="waiting", started=None, message=None),
    ]
    p = plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)["n1"]
    assert p.entry.state == "Staging" and not p.wipes
    pods[1] = pods[1]._replace(phase="Running", init="ok", started="2026-11-21T11:59:00Z", message=SUMMARY)
    assert plan_nodes(prior, pods, jobs(a=True, b=False), WIPE, NOW)["n1"].entry.state == "Ready"


def test_owner_pins_cover_the_whole_owner_chain_and_keep_the_first_revision():
    """status.owners: a JobSet's next child Job (admitted with ownerReference JobSet) must
    get the revision its first Jobs' pods stage, even after status.revision moved on."""
    from dscache_operator.control.status import owner_pins

    job_ = OwnerInfo("Job", "js-w-0", False, OwnerRef("JobSet", "js", "uid-js"))
    view = owners(**{"uid-js-w-0": job_, "uid-js": OwnerInfo("JobSet", "js", False, None)})
    pods = [pod("js-w-0-0", job="js-w-0", revision=REV)]
    pins = owner_pins(pods, view, [])
    assert {(p["kind"], p["uid"], p["revision"]) for p in pins} == {
        ("Job", "uid-js-w-0", REV),
        ("JobSet", "uid-js", REV),
    }
    # Already pinned to REV: a later pod of REV2 does not move the pin.
    pins2 = owner_pins([*pods, pod("js-w-0-1", job="js-w-0", revision=REV2)], view, pins)
    assert {p["revision"] for p in pins2} == {REV}
    # Finished owners are dropped.
    assert (
        owner_pins([pods[0]._replace(phase="Succeeded")], owners(**{"uid-js-w-0": job_._replace(finished=True)}), pins)
        == []
    )


def test_owner_pins_keep_a_revision_and_its_as_of_time_together():
    """A versioned pod's pin carries its as-of time; a prior pin keeps its own time
    (never a later pod's time with the earlier revision)."""
    from dscache_operator.cluster.caches import owner_pin_ref, revision_ref
    from dscache_operator.control.status import owner_pins, revision_fragment

    t1, t2 = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    view = owners(**{"uid-train": OwnerInfo("Job", "train", False, None)})
    first = pod("train-0")._replace(pinned=RevisionRef(REV, t1))
    (p1,) = owner_pins([first], view, [])
    assert p1 == {"uid": "uid-train", "kind": "Job", "name": "train", "revision": REV, "asOf": t1}
    assert owner_pin_ref(p1) == RevisionRef(REV, t1)
    later = pod("train-1")._replace(pinned=RevisionRef(REV2, t2))
    assert owner_pins([first, later], view, [p1]) == [p1]
    assert owner_pins([later], view, [p1]) == [p1]  # the pin outlives the pod that made it
    # Unversioned: no asOf key at all (a null in a list item would fail the schema).
    (p0,) = owner_pins([pod("train-0")], view, [])
    assert "asOf" not in p0 and owner_pin_ref(p0) == RevisionRef(REV)
    # status.revision keeps its exact shape, and reads back as the same value.
    now = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
    frag = revision_fragment(RevisionRef(REV, t1), 4, 40, now)
    assert frag == {
        "id": REV,
        "objects": 4,
        "bytes": 40,
        "listedAt": "2026-11-21T12:00:00Z",
        "versioned": True,
        "asOf": t1,
    }
    assert revision_ref(frag) == RevisionRef(REV, t1)
    frag = revision_fragment(RevisionRef(REV), None, None, now)
    assert frag == {"id": REV, "objects": 0, "bytes": 0, "listedAt": "2026-11-21T12:00:00Z", "versioned": False}
    assert revision_ref(frag) == RevisionRef(REV)
    # A status edited by hand reads as no revision, never as a half of one.
    assert revision_ref({"id": REV, "asOf": "yesterday"}) is None and revision_ref(None) is None
    assert owner_pin_ref({"uid": "u", "revision": "r-bad"}) is None


def test_pod_info_reads_the_revision_with_its_as_of_time_or_not_at_all():
    def info(annotations):
        return pod_info(
            {"metadata": {"name": "p", "uid": "u", "annotations": {"dscache.io/cache": "c", **annotations}}}
        )

    t1 = "2026-01-01T00:00:00Z"
    got = info({"dscache.io/revision": REV, "dscache.io/revision-as-of": t1})
    assert (got.pinned, got.revision) == (RevisionRef(REV, t1), REV)
    assert info({"dscache.io/revision": REV}).pinned == RevisionRef(REV)
    # Edited after admission into something unreadable: no revision, which holds
    # every revision on its node (the safe side for wipes) and pins no owner.
    for bad in (
        {"dscache.io/revision": REV, "dscache.io/revision-as-of": "yesterday"},
        {"dscache.io/revision": "../x"},
        {"dscache.io/revision-as-of": t1},
    ):
        got = info(bad)
        assert (got.pinned, got.revision) == (None, None), bad


# --- the version 1 copy (a node staged before revisions existed) ------------------------------


def v1_node(name="n1", **kw):
    """A status entry as version 1 wrote it: no revisions."""
    fields = {"state": "Ready", "consumers": 1, "lastUsed": "2026-11-21T10:00:00Z", **kw}
    return NodeStatus(node=name, **fields)


def legacy_pod(name="v1", **kw):
    return pod(name, revision=None, **kw)


def test_a_version_1_copy_is_listed_and_kept_while_a_pod_without_revision_holds_it():
    p = plan_nodes([v1_node()], [legacy_pod(job="old")], jobs(old=False), WIPE, NOW)["n1"]
    assert not p.wipes
    (legacy,) = p.entry.revisions
    assert (legacy.id, legacy.consumers, legacy.wipedAt) == (LEGACY, 1, None)
    # Finished, but its Job still runs (it may recreate the pod): still kept.
    p = plan_nodes([v1_node()], [legacy_pod(job="old", phase="Succeeded")], jobs(old=False), WIPE, NOW)["n1"]
    assert not p.wipes and p.entry.revisions[0].consumers == 1


def test_a_version_1_copy_is_wiped_once_no_legacy_holder_remains():
    p = plan_nodes([v1_node()], [legacy_pod(job="old", phase="Succeeded")], jobs(old=True), WIPE, NOW)["n1"]
    assert [(s.revision, s.release) for s in p.wipes] == [(LEGACY, ())]
    # Its old pods may be gone altogether (only the status entry remembers the copy).
    p = plan_nodes([v1_node(consumers=0)], [], jobs(), WIPE, NOW)["n1"]
    assert [s.revision for s in p.wipes] == [LEGACY]
    (step,) = p.wipes
    req = wipe.request_for("ml", "c", step)
    assert req.legacy and req.revision is None and not req.all_revisions


def test_a_version_1_copy_beside_a_current_revision_goes_alone():
    """After the upgrade a current Job runs on the node: its revision stays, the v1 copy goes."""
    prior = [v1_node(consumers=1)]
    pods = [legacy_pod(job="old", phase="Succeeded"), pod("new-0", job="new")]
    p = plan_nodes(prior, pods, jobs(old=True, new=False), WIPE, NOW)["n1"]
    assert [s.revision for s in p.wipes] == [LEGACY]
    assert {r.id: r.consumers for r in p.entry.revisions} == {LEGACY: 0, REV: 1}


def test_any_legacy_holder_blocks_the_version_1_wipe_and_every_revision_wipe():
    """It mounts C itself: it would see any of them vanish."""
    prior = [NodeStatus(node="n1", state="Ready", revisions=[NodeRevision(id=LEGACY), NodeRevision(id=REV)])]
    pods = [legacy_pod(job="old"), pod("a-0", job="a", phase="Succeeded")]
    assert not plan_nodes(prior, pods, jobs(old=False, a=True), WIPE, NOW)["n1"].wipes
    # Unscheduled (it may land here): blocks too, on every node.
    pods[0] = pods[0]._replace(node=None, phase="Pending", init=None, started=None)
    assert not plan_nodes(prior, pods, jobs(old=False, a=True), WIPE, NOW)["n1"].wipes
    # On another node it blocks nothing here.
    pods[0] = pods[0]._replace(node="n2", phase="Running", init="ok", started="2026-11-21T11:00:00Z")
    plans = plan_nodes(prior, pods, jobs(old=False, a=True), WIPE, NOW)
    assert sorted(s.revision for s in plans["n1"].wipes) == [LEGACY, REV] and not plans["n2"].wipes


def test_a_version_1_copy_waits_for_retention():
    keep = Retention(policy="RetainWhileUsed", ttlAfterLastUse="1h")
    recent = v1_node(consumers=0, lastUsed="2026-11-21T11:30:00Z")
    assert not plan_nodes([recent], [], jobs(), keep, NOW)["n1"].wipes
    old = v1_node(consumers=0, lastUsed="2026-11-21T10:30:00Z")
    assert [s.revision for s in plan_nodes([old], [], jobs(), keep, NOW)["n1"].wipes] == [LEGACY]


def test_a_wiped_version_1_copy_is_not_wiped_again_for_its_finished_pods():
    wiped = NodeRevision(id=LEGACY, wipedAt="2026-11-21T11:50:00Z")
    prior = [NodeStatus(node="n1", state="Ready", revisions=[wiped, NodeRevision(id=REV, consumers=1)], consumers=1)]
    pods = [legacy_pod(job="old", phase="Succeeded"), pod("new-0", job="new")]
    p = plan_nodes(prior, pods, jobs(old=True, new=False), WIPE, NOW)["n1"]
    assert not p.wipes and p.entry.revisions[0].wipedAt == wiped.wipedAt
    # Nor is a wiped node (or a version 1 entry the kubelet's emptyDir removed) given one.
    assert not plan_nodes([v1_node(state="Wiped")], [], jobs(), WIPE, NOW)
    assert not plan_nodes([v1_node(volume="EmptyDir", consumers=0)], [], jobs(), WIPE, NOW)["n1"].wipes


def test_deleting_a_cache_with_a_version_1_copy_removes_all_of_c_in_one_step():
    p = plan_nodes([v1_node(consumers=0)], [], jobs(), WIPE, NOW, deleting=True)["n1"]
    assert [s.revision for s in p.wipes] == [None]


def test_planning_and_recording_wipes_leave_the_prior_entries_alone():
    """The plan's entries are copies (the executor compares them with the prior ones for
    Events): a plan, and the wipes' answers recorded into it, change nothing of the prior."""
    prior = [
        NodeStatus(
            node="n1",
            state="Ready",
            consumers=1,
            lastUsed="2026-11-21T11:00:00Z",
            revisions=[
                NodeRevision(id=REV, consumers=1, lastUsed="2026-11-21T11:00:00Z", strayLeases=["uid-gone"]),
                NodeRevision(id=REV2, lastUsed="2026-11-21T10:00:00Z"),
            ],
        )
    ]
    before = [n.model_dump() for n in prior]
    plan = plan_nodes(prior, [pod(phase="Succeeded")], jobs(train=True), WIPE, NOW)["n1"]
    assert plan.wipes
    for step in plan.wipes:
        kept = wipe.WipeResult(wipe.Outcome.KEPT, "kept", "kept", leases=("uid-x",))
        wipe.record_wipe(plan.entry, step, kept, NOW)
        wipe.record_wipe(plan.entry, step, wipe.WipeResult(wipe.Outcome.REMOVED, "succeeded", None), NOW)
    wipe.settle(plan.entry, plan, NOW)
    assert plan.entry.state == "Wiped" and all(r.wipedAt for r in plan.entry.revisions)
    assert [n.model_dump() for n in prior] == before


def test_a_wipe_kept_by_the_lease_of_a_pod_we_never_saw_is_sent_again_at_once():
    """A pod that ran and was deleted before a reconciliation saw it finish: the first wipe
    (no pod to release) comes back kept by its lease, and the next plan releases that lease
    (_releasable). The cache is then due again at once, not a reconcile interval later
    (integration: test_short_pod_between_ticks_is_wiped, which failed under load on that)."""
    unreleased = wipe.Release(REV, ())
    kept = wipe.WipeResult(wipe.Outcome.KEPT, wipe.WipeCount.KEPT, "kept", leases=("uid-gone",))
    assert wipe.release_next(unreleased, kept, known=frozenset())
    # A lease of a pod in our view is the plan's to release (or not) as that pod goes: no hurry.
    assert not wipe.release_next(unreleased, kept, known=frozenset({"uid-gone"}))
    # Once only: a wipe that already tried to release it and was kept does not loop at once.
    assert not wipe.release_next(wipe.Release(REV, ("uid-gone",)), kept, known=frozenset())
    removed = wipe.WipeResult(wipe.Outcome.REMOVED, wipe.WipeCount.SUCCEEDED, None)
    assert not wipe.release_next(unreleased, removed, known=frozenset())
