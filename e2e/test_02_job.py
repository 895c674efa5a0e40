"""2. An annotated Job: staged before the (non-root) training container, verified, then wiped."""

import json

from conftest import (assert_complete, cache_status, host_copy, init_summary, node_entry, send_go,
                      wait_verified, wait_wiped)
from support import workloads as w
from support.kube import node_path_exists, node_sh, wait_for


def test_annotated_job_gets_data_and_copy_is_wiped(cfg, kube, cache_factory, dataset):
    cache = cache_factory("job")
    ns, name = cache["namespace"], cache["name"]
    job = "train-basic"
    kube.create(w.training_job(job, ns, name, cfg.stager_image, dataset, wait=True))

    # The Job and its pod were mutated by the webhook.
    jobobj = kube.get("job", job, ns)
    tpl = jobobj["spec"]["template"]["spec"]
    assert [c["name"] for c in tpl["initContainers"]] == [w.INIT_NAME]
    vol = next(v for v in tpl["volumes"] if v["name"] == "dscache-data")
    assert vol["hostPath"]["path"] == host_copy(cfg, ns, name), vol
    train = tpl["containers"][0]
    mount = next(m for m in train["volumeMounts"] if m["name"] == "dscache-data")
    assert mount == {"name": "dscache-data", "mountPath": "/data", "readOnly": True}
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["DSCACHE_DIR"] == "/data" and env["DSCACHE_MANIFEST"] == "/data/.dscache/manifest.jsonl"

    pod = wait_verified(kube, ns, job)
    pod_name = pod["metadata"]["name"]
    log = kube.logs(pod_name, ns, w.TRAIN_CONTAINER)
    assert f"VERIFIED objects={dataset.objects} bytes={dataset.bytes} uid={w.TRAIN_UID}" in log, log

    # While the pod runs: the copy is on the node's disk under cacheRoot, complete.
    path = host_copy(cfg, ns, name)
    node = pod["spec"]["nodeName"]
    assert node_path_exists(f"{path}/.dscache/complete", node), path
    count = node_sh(f"wc -l < {path}/.dscache/manifest.jsonl", node=node).stdout.strip()
    assert count == str(dataset.objects)

    summary = init_summary(kube.get("pod", pod_name, ns))
    assert summary["objects"] == dataset.objects and summary["bytes"] == dataset.bytes, summary
    assert summary["fetched_bytes"] == dataset.bytes, summary

    # The DatasetCache shows that node's bytes and seconds.
    entry = wait_for("node state Ready in the DatasetCache status",
                     lambda: (e := node_entry(kube, ns, name)).get("state") == "Ready" and e, timeout=30,
                     describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1))
    assert entry["node"] == pod["spec"]["nodeName"]
    assert entry["bytes"] == dataset.bytes and entry["objects"] == dataset.objects, entry
    assert entry["seconds"] > 0 and abs(entry["seconds"] - summary["seconds"]) < 0.01, (entry, summary)
    assert entry["volume"] == "HostPath" and entry["consumers"] == 1, entry

    send_go(kube, ns, pod_name)
    assert_complete(kube, ns, job)

    # Job complete: the node's copy is wiped from the host filesystem.
    wait_wiped(cfg, kube, ns, name, node=node)
    assert not node_path_exists(path, node)
    entry = wait_for("node state Wiped in the status",
                     lambda: (e := node_entry(kube, ns, name)).get("state") == "Wiped" and e, timeout=30)
    assert entry["bytes"] == dataset.bytes and entry["seconds"] > 0 and entry.get("wipedAt"), entry
    assert entry["consumers"] == 0
