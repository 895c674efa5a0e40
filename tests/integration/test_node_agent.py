"""The node agent (dscache-node) as a real process against the real kube-apiserver.

Each test registers a fake Node (InternalIP 127.0.0.1) and runs ``python -m
dscache_node`` for it with a cacheRoot in a temp dir (tests/support/nodeagent.py).
Copies are staged on that disk by hand, exactly as the stager leaves them; the
assertions are on the disk, on the Node's labels and annotation as the API server
has them, on Events, and on what the agent's HTTP API answers.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.integration.test_operator_api import make_cache
from tests.integration.test_operator_truth import metric
from tests.support.kubeapi import OPERATOR_NS, KubeAPI
from tests.support.nodeagent import (
    MiB,
    create_ignoring_conflict,
    inventory,
    node_labels,
    revision_on_disk,
    service_account_token,
    stage_copy,
    warm_labels,
)

pytestmark = pytest.mark.integration

_ids = itertools.count()


def rev(name: str) -> str:
    return "r-" + hashlib.sha256(name.encode()).hexdigest()[:20]


@pytest.fixture
def ns(kube_api) -> str:
    """A plain namespace (not opted in: nothing here goes through the webhook)."""
    return kube_api.namespace(f"agent-{next(_ids)}")


def consumer_pod(k: KubeAPI, ns: str, name: str, node: str) -> dict:
    """A consumer pod bound to ``node`` as the webhook labels them; its uid names its lease."""
    return k.create(
        f"/api/v1/namespaces/{ns}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"dscache.io/consumer": "true"}},
            "spec": {"nodeName": node, "restartPolicy": "Never", "containers": [{"name": "train", "image": "t"}]},
        },
    )


@contextmanager
def stager_lock(c: Path) -> Iterator[None]:
    """Hold C's flock as a stager at work does (C/lock, made if missing)."""
    c.mkdir(parents=True, exist_ok=True)
    fd = os.open(contract.lock_path(str(c)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --- (a) warm labels only for copies that match their manifest ------------------------------


def test_warm_label_only_for_a_copy_that_matches_its_manifest(kube_api, agents, ns):
    k = kube_api
    node = f"agent-a{next(_ids)}"
    root = Path(agents.workdir / node / "root")
    good, missing, short = rev("good"), rev("missing"), rev("short")
    stage_copy(root, ns, "good", good)
    c = stage_copy(root, ns, "missing", missing)
    os.unlink(Path(contract.data_dir(str(c), missing)) / "sub" / "b.bin")  # a file gone since sealing
    c = stage_copy(root, ns, "short", short)
    (Path(contract.data_dir(str(c), short)) / "a.bin").write_bytes(b"a" * 9)  # cut short by one byte
    agent = agents.start(node)

    # The first pass runs before the agent serves: its labels are there once it is ready.
    assert warm_labels(k, node) == {contract.warm_label(ns, "good", good)}
    inv = inventory(k, node)
    assert inv is not None and inv.node == node and inv.budget > 0
    held = {name: r for r in inv.revisions for name in ("good", "missing", "short") if r.of(ns, name)}
    assert set(held) == {"good", "missing", "short"}
    assert (held["good"].revision, held["good"].bytes, held["good"].complete, held["good"].labelled) == (
        good,
        35,
        True,
        True,
    )
    assert held["missing"].complete and not held["missing"].labelled
    assert held["short"].complete and not held["short"].labelled
    # Each copy: 35 bytes in 2 files, counted in the disk's blocks (disk.footprint).
    assert inv.held == 3 * (35 + 2 * os.statvfs(root).f_frsize)
    log = agent.log()
    assert "sub/b.bin (manifest line 2) is missing" in log, log[-2000:]
    assert "a.bin (manifest line 1) is not a file of 10 bytes" in log, log[-2000:]

    # A copy sealed while the agent runs is labelled at its next pass (1 s here); an
    # unfinished one (no completion marker yet) never is.
    late = rev("late")
    c = stage_copy(root, ns, "late", late)
    unfinished = stage_copy(root, ns, "unfinished", rev("unfinished"))
    os.unlink(contract.complete_path(str(unfinished), rev("unfinished")))
    k.wait_for(lambda: contract.warm_label(ns, "late", late) in warm_labels(k, node), what="the late copy labelled")
    assert warm_labels(k, node) == {contract.warm_label(ns, "good", good), contract.warm_label(ns, "late", late)}
    inv = inventory(k, node)
    assert [(r.complete, r.labelled) for r in inv.revisions if r.of(ns, "unfinished")] == [(False, False)]

    # Repaired by hand (the missing file back, at its size): verified anew, then labelled.
    c = root / ns / "missing"
    Path(contract.data_dir(str(c), missing), "sub", "b.bin").write_bytes(b"b" * 25)
    os.utime(contract.complete_path(str(c), missing))  # resealed: the marker changed
    k.wait_for(lambda: contract.warm_label(ns, "missing", missing) in warm_labels(k, node), what="repaired copy")
    assert contract.warm_label(ns, "short", short) not in warm_labels(k, node)


# --- (b) a wipe takes the label off before the copy goes ------------------------------------


def agent_token(k: KubeAPI, path: Path) -> Path:
    """A ServiceAccount token for an agent (bound to cluster-admin: RBAC is not what is tested)."""
    sa = "dscache-node-test"
    create_ignoring_conflict(
        k,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": sa},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": OPERATOR_NS}],
        },
    )
    return service_account_token(k, sa, path)


def test_a_wipe_takes_the_label_off_before_the_copy_goes(kube_api, agents, ns, tmp_path):
    k = kube_api
    node = f"agent-b{next(_ids)}"
    token = agent_token(k, tmp_path / "agent-sa-token")
    good_token = token.read_text()
    agent = agents.start(node, kube_token_file=token)
    root = agent.cache_root
    one, two = rev("one"), rev("two")
    stage_copy(root, ns, "one", one)
    stage_copy(root, ns, "two", two)
    stage_copy(root, ns, "two", rev("two-older"))
    label_one = contract.warm_label(ns, "one", one)
    k.wait_for(lambda: len(warm_labels(k, node)) == 3, what="three copies labelled")

    # Without the controller's token, no wipe at all.
    code, text = agent.wipe(contract.WipeRequest(ns, "one", revision=one), token="not-the-token")
    assert code == 401, text
    assert revision_on_disk(root, ns, "one", one)

    # The API server refuses the agent (its token revoked): the label cannot come off,
    # so the copy stays, and the controller is told why.
    token.write_text("revoked")
    code, text = agent.wipe(contract.WipeRequest(ns, "one", revision=one))
    assert code >= 500, (code, text)
    assert "401" in text, text
    assert revision_on_disk(root, ns, "one", one), "removed although its label could not be taken off"
    assert label_one in warm_labels(k, node)
    assert agent.alive()

    # Access back: the wipe removes it, and at no moment is the copy gone while the label stays.
    token.write_text(good_token)
    seen: list[tuple[bool, bool]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            on_disk = revision_on_disk(root, ns, "one", one)  # first the disk, then the Node
            seen.append((on_disk, label_one in node_labels(k, node)))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        code, text = agent.wipe(contract.WipeRequest(ns, "one", revision=one))
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(10)
    assert code == 200, text
    summary = contract.WipeSummary.from_dict(json.loads(text))
    assert summary.existed and summary.removed
    assert not revision_on_disk(root, ns, "one", one)
    assert label_one not in warm_labels(k, node)
    assert seen[0] == (True, True) and seen[-1] == (False, False), seen
    assert (False, True) not in seen, "the copy was gone while its label was still on the Node"

    # The whole cache dir: every label of that cache comes off, then C goes.
    code, text = agent.wipe(contract.WipeRequest(ns, "two", all_revisions=True))
    assert code == 200 and contract.WipeSummary.from_dict(json.loads(text)).removed, text
    assert not (root / ns / "two").exists()
    assert warm_labels(k, node) == set()
    assert [line.split(": ")[-1] for line in agent.wipes(ns, "one")] == ["removed"], agent.wipes(ns, "one")


# --- (c) killed mid-removal, restarted: the disk is the truth --------------------------------


def test_a_killed_agent_finishes_the_removal_and_its_labels_match_the_disk(kube_api, agents, ns):
    k = kube_api
    node = f"agent-c{next(_ids)}"
    root = agents.workdir / node / "root"
    keep, going, held = rev("keep"), rev("going"), rev("held")
    stage_copy(root, ns, "keep", keep)
    # A large tree, so that its removal takes a moment (about a second here).
    c_going = stage_copy(root, ns, "going", going, {f"d{i % 50}/f{i}": b"" for i in range(20000)})
    c_held = stage_copy(root, ns, "held", held, leases=("pod-uid-1",))
    stage_copy(root, ns, "whole", rev("whole"))
    agent = agents.start(node)
    assert len(warm_labels(k, node)) == 4

    # SIGKILLed while it removes a revision (the controller asked for the wipe).
    revs_root = Path(contract.revisions_root(str(c_going)))
    answer: list[object] = []
    t = threading.Thread(
        target=lambda: answer.append(_try(agent.wipe, contract.WipeRequest(ns, "going", revision=going))),
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 30
    while not any(revs_root.glob(".gone-*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    agent.stop(kill=True)
    t.join(30)
    leftovers = list(revs_root.glob(".gone-*"))
    assert leftovers, "the removal was over before the kill: nothing left to finish"
    assert not revision_on_disk(root, ns, "going", going)
    assert isinstance(answer[0], OSError), answer  # the controller got no answer: it would ask again
    # Its label came off before the copy went, so the Node never claimed the half-removed tree.
    assert contract.warm_label(ns, "going", going) not in warm_labels(k, node)
    # While it is down: a whole cache dir left half removed by another killed process, and a
    # label of a revision this disk does not hold (as if the disk were replaced meanwhile).
    os.rename(root / ns / "whole", root / ns / ".gone-whole-4242-2")
    stray = contract.warm_label(ns, "elsewhere", rev("elsewhere"))
    k.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {stray: "true"}}})

    agent.start()  # ready = its first pass is done
    # The leftovers are removed off the agent's lock, by its remover: soon after its first pass.
    k.wait_for(
        lambda: not any(revs_root.glob(".gone-*")) and not (root / ns / ".gone-whole-4242-2").exists(),
        timeout=20,
        what="the leftovers removed",
    )
    assert warm_labels(k, node) == {contract.warm_label(ns, "keep", keep), contract.warm_label(ns, "held", held)}
    assert os.path.exists(contract.lease_path(str(c_held), held, "pod-uid-1")), "a lease was lost"
    assert revision_on_disk(root, ns, "keep", keep) and revision_on_disk(root, ns, "held", held)
    inv = inventory(k, node)
    assert {(r.of(ns, "keep"), r.revision, r.leases, r.labelled) for r in inv.revisions} == {
        (True, keep, 0, True),
        (False, held, 1, True),
    }
    assert "finishing 2 removal(s) a killed process had left" in agent.log()
    # The controller asks again: nothing is left, and it is told so.
    code, text = agent.wipe(contract.WipeRequest(ns, "going", revision=going))
    assert code == 200 and not contract.WipeSummary.from_dict(json.loads(text)).existed, text


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


# --- (d) the byte budget: LRU eviction, never a leased copy, refusal naming both numbers -------


def test_the_budget_evicts_the_least_recently_released_copy_never_a_leased_one(kube_api, agents, ns):
    k = kube_api
    node = f"agent-d{next(_ids)}"
    for name in ("lru-held", "lru-a", "lru-b", "lru-c", "lru-new", "lru-new2", "lru-huge"):
        make_cache(k, ns, name, "s3://nowhere/x/", "http://127.0.0.1:9")
    reader = consumer_pod(k, ns, "reader", node)  # Pending on the node: its lease holds
    root = agents.workdir / node / "root"
    now = time.time()
    blob = {"blob": b"x" * MiB}
    r = {name: rev(name) for name in ("lru-held", "lru-a", "lru-b", "lru-c", "lru-new", "lru-new2", "lru-huge")}
    # The leased copy was released longest ago, yet it is in use.
    stage_copy(root, ns, "lru-held", r["lru-held"], blob, leases=(reader["metadata"]["uid"],), released_at=now - 400)
    stage_copy(root, ns, "lru-b", r["lru-b"], blob, released_at=now - 200)
    stage_copy(root, ns, "lru-a", r["lru-a"], blob, released_at=now - 300)
    stage_copy(root, ns, "lru-c", r["lru-c"], blob, released_at=now - 100)
    # Four copies of one file of 1 MiB each, in the disk's blocks (disk.footprint): the budget is full.
    root.mkdir(parents=True, exist_ok=True)
    each = MiB + os.statvfs(root).f_frsize
    agent = agents.start(node, env_extra={"DSCACHE_NODE_BUDGET": str(4 * each)})
    assert inventory(k, node).held == 4 * each and inventory(k, node).budget == 4 * each

    # No stager holds the cache's lock: no copy in progress, nothing reserved or evicted.
    code, answer = agent.reserve(ns, "lru-new", r["lru-new"], MiB)
    assert code == 200 and not answer.ok and "no stager holds the lock" in answer.message, answer
    assert all(revision_on_disk(root, ns, n, r[n]) for n in ("lru-held", "lru-a", "lru-b", "lru-c"))

    with stager_lock(root / ns / "lru-new"), stager_lock(root / ns / "lru-new2"), stager_lock(root / ns / "lru-huge"):
        code, answer = agent.reserve(ns, "lru-new", r["lru-new"], MiB)
        assert code == 200 and answer.ok, answer
        assert answer.evicted == [f"{ns}/lru-a/{r['lru-a']}"], answer
        assert not revision_on_disk(root, ns, "lru-a", r["lru-a"])
        assert revision_on_disk(root, ns, "lru-held", r["lru-held"]), "a leased copy was evicted"

        code, answer = agent.reserve(ns, "lru-new2", r["lru-new2"], MiB)
        assert code == 200 and answer.ok and answer.evicted == [f"{ns}/lru-b/{r['lru-b']}"], answer

        # Bigger than the whole budget: refused, naming both numbers; nothing else goes.
        code, answer = agent.reserve(ns, "lru-huge", r["lru-huge"], 5 * MiB)
        assert code == 200 and not answer.ok and answer.evicted == [], answer
        assert str(5 * MiB) in answer.message and f"budget is {4 * each} bytes" in answer.message, answer.message
        assert revision_on_disk(root, ns, "lru-c", r["lru-c"]) and revision_on_disk(root, ns, "lru-held", r["lru-held"])
        assert contract.warm_label(ns, "lru-a", r["lru-a"]) not in warm_labels(k, node)

    def evicted_events() -> list[dict]:
        items = k.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
        return [e for e in items if e["reason"] == "Evicted"]

    events = k.wait_for(lambda: (lambda e: e if len(e) >= 2 else None)(evicted_events()), what="Evicted events")
    assert sorted(e["involvedObject"]["name"] for e in events) == ["lru-a", "lru-b"], events
    for e in events:
        dsc = k.get(f"/apis/dscache.io/v1alpha1/namespaces/{ns}/datasetcaches/{e['involvedObject']['name']}")
        assert e["involvedObject"]["uid"] == dsc["metadata"]["uid"]
        assert e["involvedObject"]["kind"] == "DatasetCache" and e["source"]["host"] == node
        assert "least recently used first" in e["message"] and node in e["message"]
    text = agent.metrics()
    assert metric(text, "dscache_node_evicted_bytes_total") == 2 * MiB
    assert metric(text, "dscache_node_reservations_refused_total") == 1


# --- (e) leases of pods that finished on the node are released ------------------------------


def test_leases_of_finished_pods_are_released(kube_api, agents, ns):
    k = kube_api
    node = f"agent-e{next(_ids)}"
    register = agents.start(node)
    root = register.cache_root
    done = consumer_pod(k, ns, "done", node)
    running = consumer_pod(k, ns, "running", node)
    deleted = consumer_pod(k, ns, "deleted", node)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in (done, running, deleted)}
    shared = rev("shared")
    c = stage_copy(root, ns, "shared", shared, leases=tuple(uids.values()))

    def lease(name: str) -> bool:
        return os.path.exists(contract.lease_path(str(c), shared, uids[name]))

    k.merge_patch(f"/api/v1/namespaces/{ns}/pods/running/status", {"status": {"phase": "Running"}})
    k.merge_patch(f"/api/v1/namespaces/{ns}/pods/done/status", {"status": {"phase": "Succeeded"}})
    k.wait_for(lambda: not lease("done"), timeout=20, what="the finished pod's lease released")
    # Gone from the API server (as the kubelet confirms a deletion; there is no kubelet here).
    k.request(
        "DELETE",
        f"/api/v1/namespaces/{ns}/pods/deleted",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )
    k.wait_for(lambda: not lease("deleted"), timeout=20, what="the deleted pod's lease released")
    time.sleep(2)  # two more passes
    assert lease("running"), "the lease of a running pod was released"
    # Releasing is not wiping: the copy stays, labelled, for the controller to decide.
    assert revision_on_disk(root, ns, "shared", shared)
    assert contract.warm_label(ns, "shared", shared) in warm_labels(k, node)
    assert [(r.of(ns, "shared"), r.leases) for r in inventory(k, node).revisions] == [(True, 1)]
