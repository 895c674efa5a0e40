"""Consumer tracking and per-node plans (pure, level-based logic)."""

from __future__ import annotations

import datetime

from dscache_operator.consumers import (PodInfo, job_finished, plan_nodes, pod_info,
                                        termination_summary)
from dscache_operator.models import NodeStatus, Retention
from dscache_operator.settings import Settings
from dscache_operator import wipe

NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.timezone.utc)
WIPE = Retention()
SUMMARY = '{"objects": 3, "bytes": 300, "skipped": 0, "fetched_bytes": 300, "seconds": 1.5, "mb_s": 0.2}'


def pod(name="p", node="n1", phase="Running", job="train", init="ok", started="2026-11-21T11:00:00Z",
        message=SUMMARY, mode="HostPath"):
    return PodInfo(name, node, phase, job, mode, init, started, message)


def jobs(**state):
    return lambda name: state.get(name)


def test_pod_info_reads_init_status_and_owner():
    body = {"metadata": {"name": "p", "namespace": "ml",
                         "annotations": {"dscache.io/cache": "c", "dscache.io/volume": "HostPath"},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train"}]},
            "spec": {"nodeName": "gpu-1"},
            "status": {"phase": "Running", "initContainerStatuses": [{
                "name": "dscache-stage", "state": {"terminated": {
                    "exitCode": 0, "startedAt": "2026-11-21T11:00:00Z", "message": SUMMARY}}}]}}
    info = pod_info(body)
    assert (info.node, info.job, info.init, info.mode) == ("gpu-1", "train", "ok", "HostPath")
    assert termination_summary(info.message)["bytes"] == 300


def test_job_finished():
    assert job_finished({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    assert job_finished({"status": {"conditions": [{"type": "Failed", "status": "True"}]}})
    assert not job_finished({"status": {"conditions": [{"type": "Suspended", "status": "True"}]}})
    assert not job_finished({})


def test_running_consumer_makes_ready_node_without_wipe():
    plans = plan_nodes([], [pod()], jobs(train=False), WIPE, NOW)
    p = plans["n1"]
    assert p.entry.state == "Ready" and p.entry.bytes == 300 and p.entry.seconds == 1.5
    assert p.entry.consumers == 1 and not p.wipe


def test_staging_and_failed_states():
    assert plan_nodes([], [pod(init="running", message=None)], jobs(train=False), WIPE, NOW)["n1"].entry.state == "Staging"
    failed = plan_nodes([], [pod(phase="Failed", init="failed", message="error: bucket gone")],
                        jobs(train=False), WIPE, NOW)["n1"]
    assert failed.entry.state == "Failed" and "bucket gone" in failed.entry.message


def test_completed_job_wipes_node():
    prior = [NodeStatus(node="n1", state="Ready", consumers=1)]
    p = plan_nodes(prior, [pod(phase="Succeeded")], jobs(train=True), WIPE, NOW)["n1"]
    assert p.wipe and p.entry.consumers == 0


def test_finished_pod_of_running_job_still_consumes():
    p = plan_nodes([], [pod(phase="Succeeded")], jobs(train=False), WIPE, NOW)["n1"]
    assert not p.wipe and p.entry.consumers == 1


def test_other_live_consumer_on_node_prevents_wipe():
    pods = [pod(phase="Succeeded", job="a"), pod(name="q", job="b")]
    p = plan_nodes([], pods, jobs(a=True, b=False), WIPE, NOW)["n1"]
    assert not p.wipe and p.entry.consumers == 1


def test_each_node_decided_separately():
    pods = [pod(node="n1", phase="Succeeded", job="a"), pod(name="q", node="n2", job="b")]
    plans = plan_nodes([], pods, jobs(a=True, b=False), WIPE, NOW)
    assert plans["n1"].wipe and not plans["n2"].wipe


def test_retain_while_used_waits_for_ttl():
    keep = Retention(policy="RetainWhileUsed", ttlAfterLastUse="1h")
    recent = [NodeStatus(node="n1", state="Ready", consumers=0, lastUsed="2026-11-21T11:30:00Z")]
    assert not plan_nodes(recent, [pod(phase="Succeeded")], jobs(train=True), keep, NOW)["n1"].wipe
    old = [NodeStatus(node="n1", state="Ready", consumers=0, lastUsed="2026-11-21T10:30:00Z")]
    assert plan_nodes(old, [pod(phase="Succeeded")], jobs(train=True), keep, NOW)["n1"].wipe


def test_wiped_node_stays_wiped_for_old_pods_and_restages_for_new_ones():
    prior = [NodeStatus(node="n1", state="Wiped", wipedAt="2026-11-21T11:30:00Z", bytes=300)]
    old = pod(phase="Succeeded", started="2026-11-21T11:00:00Z")
    p = plan_nodes(prior, [old], jobs(train=True), WIPE, NOW)["n1"]
    assert p.entry.state == "Wiped" and not p.wipe
    new = pod(name="q", job="t2", init="running", message=None, started="2026-11-21T11:45:00Z")
    p = plan_nodes(prior, [old, new], jobs(train=True, t2=False), WIPE, NOW)["n1"]
    assert p.entry.state == "Staging" and not p.wipe


def test_emptydir_copies_need_no_helper():
    prior = [NodeStatus(node="n1", state="Ready", volume="EmptyDir", consumers=1)]
    p = plan_nodes(prior, [pod(phase="Succeeded", mode="EmptyDir")], jobs(train=True), WIPE, NOW)["n1"]
    assert p.entry.state == "Wiped" and not p.wipe


def test_unscheduled_and_stale_pods_create_no_entries():
    plans = plan_nodes([], [pod(node=None), pod(name="old", phase="Succeeded", init=None, started=None)],
                       jobs(train=True), WIPE, NOW)
    assert plans == {}


def test_deletion_wipes_even_retained_copies():
    keep = Retention(policy="RetainWhileUsed", ttlAfterLastUse="30d")
    prior = [NodeStatus(node="n1", state="Ready", consumers=0, lastUsed="2026-11-21T11:59:00Z")]
    assert plan_nodes(prior, [], jobs(), keep, NOW, deleting=True)["n1"].wipe


def test_wipe_helper_pod_is_pinned_tolerant_and_confined():
    s = Settings(cache_root="/mnt/nvme/dscache", namespace="dscache-system", stager_image="stager:t")
    pod_ = wipe.helper_pod("ml", "imagenet", "gpu-7", s)
    assert pod_["metadata"]["name"] == wipe.helper_name("ml", "imagenet", "gpu-7")
    assert pod_["metadata"]["name"] != wipe.helper_name("ml", "imagenet", "gpu-8")
    assert pod_["metadata"]["namespace"] == "dscache-system"
    spec = pod_["spec"]
    assert spec["nodeName"] == "gpu-7"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["automountServiceAccountToken"] is False
    (c,) = spec["containers"]
    assert c["args"] == ["wipe", "/mnt/nvme/dscache/ml/imagenet", "--root", "/mnt/nvme/dscache"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert spec["volumes"] == [{"name": "cache-root", "hostPath": {
        "path": "/mnt/nvme/dscache", "type": "DirectoryOrCreate"}}]


def test_long_wiped_nodes_without_pods_are_forgotten():
    recent = NodeStatus(node="n1", state="Wiped", wipedAt="2026-11-21T11:30:00Z")
    old = NodeStatus(node="n2", state="Wiped", wipedAt="2026-11-21T09:00:00Z")
    old_with_pod = NodeStatus(node="n3", state="Wiped", wipedAt="2026-11-21T09:00:00Z")
    plans = plan_nodes([recent, old, old_with_pod],
                       [pod(node="n3", phase="Succeeded", started="2026-11-21T08:00:00Z")],
                       jobs(train=True), WIPE, NOW)
    assert sorted(plans) == ["n1", "n3"]
    assert not plans["n3"].wipe and plans["n3"].entry.state == "Wiped"
