"""The wipe driver (operator side): one step per reconciliation, with a fake API client."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging

import kopf
import pytest

from dscache_operator import wipe
from dscache_operator.consumers import Release
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


def test_a_whole_cache_wipe_reports_rev_slash_uid_leases_that_come_back_as_plain_uids(events):
    """--all reports "<rev>/<uid>"; the next wipe's --release must get the UIDs (and
    the helper pod must be buildable with them: WipeArgs refuses anything else)."""
    summary = {
        "cache": "/x",
        "revision": None,
        "released": [],
        "removed": False,
        "existed": True,
        "leases": [f"{REV}/u9", f"{REV}/u8", "r-ffffffffffffffffffff/u9", "not a uid/.."],
    }
    kube = FakeKube(helper("Succeeded", exit_code=0, message=json.dumps(summary)))
    entry, kept = NodeStatus(node="n1", state="Ready"), []
    assert drive(kube, entry, step=Release(None, ()), leases=kept) is wipe.Outcome.KEPT
    assert kept == ["u8", "u9"]
    args = wipe.helper_args("ml", "c", S, None, tuple(kept))
    assert args[args.index("--release") + 1] == "u8,u9" and "--all" in args


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
