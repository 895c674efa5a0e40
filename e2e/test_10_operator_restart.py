"""6. The operator's controller process is killed mid-Job; the node's copy is still wiped afterwards.

The kill is a SIGKILL sent on the node to the controller container's processes
(found by the container ID in the pod status): no API delete, no SIGTERM from
the kubelet, no graceful kopf shutdown. The kubelet then restarts the
container in the same pod; its lastState shows exit 137 (128 + SIGKILL).
"""

import json

from conftest import (
    RELEASE_NS,
    assert_complete,
    cache_status,
    host_copy,
    leader_pod,
    node_entry,
    send_go,
    wait_verified,
)
from support import revs
from support import workloads as w
from support.kube import node_path_exists, node_pids_of_container, node_sh, wait_for


def _controller_pod(kube) -> dict:
    # The leader: the replica that would send the wipe (the standby takes over if it stays down).
    return leader_pod(kube)


def _status(pod: dict) -> dict:
    (cs,) = pod["status"]["containerStatuses"]
    return cs


def test_wipe_survives_controller_kill(cfg, kube, cache_factory, dataset):
    cache = cache_factory("restart")
    ns, name = cache["namespace"], cache["name"]
    kube.create(w.training_job("train-restart", ns, name, cfg.stager_image, dataset, wait=True))
    pod = wait_verified(kube, ns, "train-restart")
    node = pod["spec"]["nodeName"]
    wait_for("node Ready in the status", lambda: node_entry(kube, ns, name).get("state") == "Ready", timeout=30)
    rev = revs.pod_revision(pod)
    assert node_path_exists(revs.complete_marker(host_copy(cfg, ns, name), rev), node)

    ctl = _controller_pod(kube)
    ctl_name, ctl_node = ctl["metadata"]["name"], ctl["spec"]["nodeName"]
    before = _status(ctl)
    assert before.get("ready") and before.get("containerID"), before
    pids = node_pids_of_container(before["containerID"], ctl_node)
    assert pids, f"no processes found for the controller container {before['containerID']}"
    # SIGKILL, by PID, on the node (the e2e suite runs as root there).
    kill = node_sh("kill -KILL " + " ".join(str(p) for p in pids), node=ctl_node)
    assert kill.returncode == 0, kill.stderr

    # The Job finishes while no controller runs (or while it restarts).
    send_go(kube, ns, pod["metadata"]["name"])
    assert_complete(kube, ns, "train-restart")

    revs.wait_revision_wiped(kube, ns, name, host_copy(cfg, ns, name), rev, node, timeout=150)
    # The same pod, its container restarted by the kubelet after a SIGKILL (exit 137).
    after = wait_for(
        "the controller container restarted and Ready",
        lambda: (
            (cs := _status(kube.get("pod", ctl_name, RELEASE_NS))).get("restartCount", 0)
            > before.get("restartCount", 0)
            and cs.get("ready")
            and cs
        ),
        timeout=120,
    )
    last = (after.get("lastState") or {}).get("terminated") or {}
    assert last.get("exitCode") == 137, f"the controller did not die of SIGKILL: {last}"
    wait_for(
        "node state Wiped in the status",
        lambda: node_entry(kube, ns, name).get("state") == "Wiped",
        timeout=60,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
