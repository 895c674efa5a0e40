"""8. The per-pod emptyDir mode, in a namespace that asks for it (dscache.io/volume=emptyDir) and
enforces Pod Security restricted; and the control that baseline really forbids hostPath (a
baseline or restricted namespace gets the node's copy through the CSI volume: test_27_csi.py)."""

import json

from conftest import assert_complete, cache_status, host_copy, init_summary, job_pods, node_entry
from support import workloads as w
from support.kube import node_path_exists, wait_for


def test_emptydir_namespace(cfg, kube, cache_factory, dataset, namespaces):
    ns = namespaces["emptydir"]
    cache = cache_factory("psa", namespace=ns)
    name = cache["name"]
    kube.create(w.training_job("train-psa", ns, name, cfg.stager_image, dataset))
    tpl = kube.get("job", "train-psa", ns)["spec"]["template"]
    vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "dscache-data")
    assert "emptyDir" in vol and "hostPath" not in vol, vol
    assert tpl["metadata"]["annotations"]["dscache.io/volume"] == "EmptyDir"
    init = tpl["spec"]["initContainers"][0]
    assert init["securityContext"]["runAsNonRoot"] is True, init["securityContext"]

    assert_complete(kube, ns, "train-psa")
    pod = job_pods(kube, ns, "train-psa")[0]
    log = kube.logs(pod["metadata"]["name"], ns, w.TRAIN_CONTAINER)
    assert f"VERIFIED objects={dataset.objects} bytes={dataset.bytes}" in log, log
    summary = init_summary(pod)
    assert summary["fetched_bytes"] == dataset.bytes
    # Nothing on the host under cacheRoot for this namespace.
    assert not node_path_exists(host_copy(cfg, ns, name), pod["spec"]["nodeName"])
    entry = wait_for(
        "an EmptyDir node entry",
        lambda: (e := node_entry(kube, ns, name)).get("volume") == "EmptyDir" and e.get("state") == "Wiped" and e,
        timeout=30,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    assert entry["bytes"] == dataset.bytes, entry


def test_baseline_namespace_refuses_hostpath_pods(cfg, kube, release, namespaces):
    """The control: the namespace really enforces baseline (a hostPath pod is refused)."""
    ns = namespaces["baseline"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hostpath-probe", "namespace": ns},
        "spec": {
            "containers": [{"name": "c", "image": cfg.stager_image, "imagePullPolicy": "Never"}],
            "volumes": [{"name": "h", "hostPath": {"path": "/tmp"}}],
        },
    }
    p = kube.create(pod, check=False)
    assert p.returncode != 0 and "hostPath" in p.stderr and "baseline" in p.stderr, p.stderr
