"""The wipe driver (operator side): one step per reconciliation, with a fake API client."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging

import kopf
import pytest

from dscache_contract import WipeArgs
from dscache_operator import wipe
from dscache_operator.consumers import LEGACY, Release
from dscache_operator.metrics import Metrics
from dscache_operator.models import NodeStatus
from dscache_operator.settings import Settings

S = Settings(cache_root="/mnt/nvme/dscache", namespace="dscache-system", stager_image="stager:t")
REV = "r-0123456789abcdef0123"
NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
NAME = wipe.helper_name("ml", "c", "n1", REV)


class FakeKube:
    def __init__(self, pod=None):
        self.pod, self.created, self.deleted = pod, [], []

    async def get_pod(self, ns, name):
        return self.pod

    async def create_pod(self, ns, pod):
        self.created.append(pod)
        return pod

    async def delete_pod(self, ns, name):
        self.deleted.append(name)


@pytest.fixture
def events(monkeypatch):
    got = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: got.append(kw))
    return got


def helper(phase, created="2026-11-21T11:59:00Z", exit_code=None, message="", waiting=None):
    status = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [
            {"name": "wipe", "state": {"terminated": {"exitCode": exit_code, "message": message}}}
        ]
    if waiting:
        status["containerStatuses"] = [{"name": "wipe", "state": {"waiting": waiting}}]
    return {"metadata": {"name": "h", "creationTimestamp": created}, "status": status}


STEP = Release(REV, ("u1",))


def drive(kube, entry, step=STEP, leases=None, metrics=None):
    metrics = metrics or Metrics()
    outcome, kept = asyncio.run(
        wipe.drive(kube, S, metrics, {}, "ml", "c", entry, step, None, logging.getLogger("t"), now=NOW)
    )
    if leases is not None:
        leases.extend(kept)
    return outcome


def test_creates_the_helper_with_the_release_list(events):
    kube, entry = FakeKube(None), NodeStatus(node="n1", state="Ready")
    assert drive(kube, entry) is wipe.Outcome.IN_PROGRESS
    (pod,) = kube.created
    assert "--release" in pod["spec"]["containers"][0]["args"] and events[0]["reason"] == "Wiping"


def test_a_helper_stuck_pending_times_out_with_an_event(events):
    entry = NodeStatus(node="n1", state="Ready")
    young = FakeKube(helper("Pending", created="2026-11-21T11:59:30Z"))
    assert drive(young, entry) is wipe.Outcome.IN_PROGRESS and not young.deleted and not events
    stuck = FakeKube(
        helper(
            "Pending",
            created="2026-11-21T11:55:00Z",
            waiting={"reason": "ImagePullBackOff", "message": "no such image"},
        )
    )
    assert drive(stuck, entry) is wipe.Outcome.IN_PROGRESS
    assert stuck.deleted == [NAME]
    (ev,) = events
    assert ev["type"] == "Warning" and ev["reason"] == "WipeStuck" and "ImagePullBackOff" in ev["message"]
    assert "stuck Pending" in entry.message


def test_leases_we_did_not_release_keep_the_revision(events):
    summary = {"cache": "/x", "revision": REV, "released": ["u1"], "removed": False, "existed": True, "leases": ["u9"]}
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(summary)))
    entry, kept = NodeStatus(node="n1", state="Ready"), []
    assert drive(kube, entry, leases=kept) is wipe.Outcome.KEPT and kept == ["u9"]
    assert "u9" in entry.message and kube.deleted == [NAME]


def test_a_whole_cache_wipe_kept_by_leases_and_stray_entries_says_both(events):
    """--all reports plain UIDs (once each, over every revision): they come back as
    --release as they are. Stray entries are no pod's lease: the node's message names
    them, and they are never passed on (WipeArgs refuses anything but a UID)."""
    summary = {
        "cache": "/mnt/nvme/dscache/ml/c",
        "revision": None,
        "released": [],
        "removed": False,
        "existed": True,
        "leases": ["u8", "u9"],
        "stray": [f"leases/{REV}/not a uid", "leases/README"],
    }
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(summary)))
    entry, kept = NodeStatus(node="n1", state="Ready"), []
    assert drive(kube, entry, step=Release(None, ()), leases=kept) is wipe.Outcome.KEPT
    assert kept == ["u8", "u9"]
    args = wipe.helper_args("ml", "c", S, None, tuple(kept))
    assert args[args.index("--release") + 1] == "u8,u9" and "--all" in args
    assert "lease(s) of pod(s) u8, u9 remain" in entry.message
    assert f"leases/{REV}/not a uid, leases/README" in entry.message and "by hand" in entry.message
    assert "/mnt/nvme/dscache/ml/c" in entry.message


def test_a_cut_report_still_keeps_and_says_so(events):
    summary = {"cache": "/x", "revision": REV, "existed": True, "leases": ["u1"], "truncated": True}
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(summary)))
    entry, kept = NodeStatus(node="n1", state="Ready"), []
    assert drive(kube, entry, leases=kept) is wipe.Outcome.KEPT and kept == ["u1"]
    assert "more not listed" in entry.message


def test_only_plain_uids_go_back_as_release():
    assert wipe.lease_uids(["u9", f"{REV}/u8", "u9", "../x"]) == ["u9"]


def test_a_stray_entry_alone_keeps_it_with_a_message(events):
    summary = {"cache": "/x", "revision": REV, "removed": False, "existed": True, "leases": [], "stray": ["leases/j"]}
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(summary)))
    entry, kept = NodeStatus(node="n1", state="Ready"), []
    assert drive(kube, entry, leases=kept) is wipe.Outcome.KEPT and kept == []
    assert entry.message.startswith(f"revision {REV} kept: 1 entry(ies) under /x that are no lease: leases/j")


def test_the_legacy_step_runs_wipe_legacy_without_releases(events):
    step = Release(LEGACY, ())
    kube, entry = FakeKube(None), NodeStatus(node="n1", state="Ready")
    assert drive(kube, entry, step=step) is wipe.Outcome.IN_PROGRESS
    (pod,) = kube.created
    assert pod["metadata"]["name"] == wipe.helper_name("ml", "c", "n1", LEGACY) != NAME
    assert WipeArgs.from_argv(pod["spec"]["containers"][0]["args"]) == WipeArgs(
        "/mnt/nvme/dscache/ml/c", "/mnt/nvme/dscache", legacy=True, termination_log="/dev/termination-log"
    )
    assert "predates revisions" in events[0]["message"]
    # Busy (a version 1 stager at work, or one that ran moments ago): retried quietly.
    busy = FakeKube(helper("Failed", exit_code=8, message="error: a version 1 stager ran in /x 5 s ago"))
    assert drive(busy, entry, step=step) is wipe.Outcome.IN_PROGRESS and entry.message is None
    done = {"cache": "/x", "legacy": True, "existed": True, "removed": True, "legacy_entries": 3}
    ok = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(done)))
    assert drive(ok, entry, step=step) is wipe.Outcome.REMOVED
    assert events[-1]["reason"] == "Wiped" and "predates revisions" in events[-1]["message"]


def test_removed_and_busy(events):
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps({"removed": True, "existed": True})))
    m = Metrics()
    assert drive(kube, NodeStatus(node="n1", state="Ready"), metrics=m) is wipe.Outcome.REMOVED
    busy = FakeKube(helper("Failed", exit_code=8, message="error: busy"))
    entry = NodeStatus(node="n1", state="Ready")
    assert drive(busy, entry, metrics=m) is wipe.Outcome.IN_PROGRESS
    wipes = {
        r: m.registry.get_sample_value("dscache_wipes_total", {"namespace": "ml", "cache": "c", "result": r})
        for r in ("succeeded", "busy", "failed")
    }
    assert wipes == {"succeeded": 1.0, "busy": 1.0, "failed": None}
    assert busy.deleted == [NAME] and entry.message is None
    assert not any(e["reason"] == "WipeFailed" for e in events)


def test_helper_pods_get_the_charts_pull_secrets():
    import dataclasses

    assert "imagePullSecrets" not in wipe.helper_pod("ml", "c", "n1", S, REV)["spec"]
    s = dataclasses.replace(S, image_pull_secrets=("regcred", "other"))
    pod = wipe.helper_pod("ml", "c", "n1", s, REV)
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
