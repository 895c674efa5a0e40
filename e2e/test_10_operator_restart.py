"""6. The operator's controller pod is killed mid-Job; the node's copy is still wiped afterwards."""

import json

from conftest import (assert_complete, RELEASE_NS, cache_status, host_copy, node_entry, send_go, wait_verified,
                      wait_wiped)
from support import workloads as w
from support.kube import node_path_exists, wait_for

CONTROLLER = "app.kubernetes.io/component=controller"


def _controller_pods(kube):
    return [p for p in kube.items("pods", namespace=RELEASE_NS, selector=CONTROLLER)
            if not p["metadata"].get("deletionTimestamp")]


def test_wipe_survives_controller_kill(cfg, kube, cache_factory, dataset):
    cache = cache_factory("restart")
    ns, name = cache["namespace"], cache["name"]
    kube.create(w.training_job("train-restart", ns, name, cfg.stager_image, dataset, wait=True))
    pod = wait_verified(kube, ns, "train-restart")
    wait_for("node Ready in the status", lambda: node_entry(kube, ns, name).get("state") == "Ready", timeout=30)
    assert node_path_exists(f"{host_copy(cfg, ns, name)}/.dscache/complete")

    old = _controller_pods(kube)
    assert len(old) == 1, [p["metadata"]["name"] for p in old]
    old_name = old[0]["metadata"]["name"]
    # Kill it hard, mid-Job (no graceful kopf shutdown).
    kube.kubectl("delete", "pod", old_name, "-n", RELEASE_NS, "--grace-period=0", "--force", "--wait=false")
    # The Job finishes while no controller runs (or a new one is still starting).
    send_go(kube, ns, pod["metadata"]["name"])
    assert_complete(kube, ns, "train-restart")

    wait_wiped(cfg, kube, ns, name, timeout=150)
    new = wait_for("a new controller pod, Ready", lambda: [
        p for p in _controller_pods(kube) if p["metadata"]["name"] != old_name and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions", []))],
        timeout=120)
    assert new
    wait_for("node state Wiped in the status", lambda: node_entry(kube, ns, name).get("state") == "Wiped",
             timeout=60, describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1))
