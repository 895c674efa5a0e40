"""9. A Kubeflow-style pod-template annotation is honoured on a bare Pod (no Job owns it)."""

from conftest import init_summary, wait_wiped
from support import workloads as w
from support.kube import wait_for


def test_bare_pod_with_template_annotation(cfg, kube, cache_factory, dataset):
    cache = cache_factory("kubeflow")
    ns, name = cache["namespace"], cache["name"]
    kube.create(w.bare_pod("pytorchjob-mnist-master-0", ns, name, cfg.stager_image, dataset))
    pod = kube.get("pod", "pytorchjob-mnist-master-0", ns)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [w.INIT_NAME]
    phase = wait_for("the Pod to finish", lambda: (kube.get("pod", "pytorchjob-mnist-master-0", ns)
                                                   ["status"].get("phase") in ("Succeeded", "Failed"))
                     and kube.get("pod", "pytorchjob-mnist-master-0", ns)["status"]["phase"], timeout=180)
    pod = kube.get("pod", "pytorchjob-mnist-master-0", ns)
    log = kube.logs("pytorchjob-mnist-master-0", ns, w.TRAIN_CONTAINER)
    assert phase == "Succeeded", log
    assert f"VERIFIED objects={dataset.objects}" in log, log
    assert init_summary(pod)["bytes"] == dataset.bytes
    # A finished bare pod is no longer a consumer: its node's copy is wiped.
    wait_wiped(cfg, kube, ns, name)
