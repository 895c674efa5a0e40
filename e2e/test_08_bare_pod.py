"""9. A Kubeflow-style pod-template annotation is honoured on a bare Pod (no Job owns it)."""

from conftest import host_copy, init_summary, send_go
from support import revs
from support import workloads as w
from support.kube import node_path_exists, wait_for

POD = "pytorchjob-mnist-master-0"


def test_bare_pod_with_template_annotation(cfg, kube, cache_factory, dataset):
    cache = cache_factory("kubeflow")
    ns, name = cache["namespace"], cache["name"]
    kube.create(w.bare_pod(POD, ns, name, cfg.stager_image, dataset, wait=True))
    pod = kube.get("pod", POD, ns)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [w.INIT_NAME]

    def verified():
        got = kube.get("pod", POD, ns)
        if got["status"].get("phase") == "Failed":
            raise AssertionError(kube.logs(POD, ns, w.TRAIN_CONTAINER))
        return "VERIFIED" in kube.logs(POD, ns, w.TRAIN_CONTAINER) and got

    pod = wait_for("the Pod's training container to verify the data", verified, timeout=180)
    node = pod["spec"]["nodeName"]
    # The copy is on the node while the pod runs, so the wipe below is real.
    rev = revs.pod_revision(pod)
    assert node_path_exists(revs.complete_marker(host_copy(cfg, ns, name), rev), node)
    send_go(kube, ns, POD)
    phase = wait_for(
        "the Pod to finish",
        lambda: (
            (kube.get("pod", POD, ns)["status"].get("phase") in ("Succeeded", "Failed"))
            and kube.get("pod", POD, ns)["status"]["phase"]
        ),
        timeout=180,
    )
    pod = kube.get("pod", POD, ns)
    log = kube.logs(POD, ns, w.TRAIN_CONTAINER)
    assert phase == "Succeeded", log
    assert f"VERIFIED objects={dataset.objects}" in log, log
    assert init_summary(pod)["bytes"] == dataset.bytes
    # A finished bare pod is no longer a consumer: its node's copy is wiped.
    revs.wait_revision_wiped(kube, ns, name, host_copy(cfg, ns, name), rev, node)
