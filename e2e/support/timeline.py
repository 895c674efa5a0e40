"""One Job's timeline, from create to the training program's first line (shared by the cold and warm runs)."""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

from support import workloads as w


def ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def measure(kube: Any, job_obj: dict[str, Any], wait_complete: Any, pods_of: Any, summary_of: Any) -> dict[str, Any]:
    """Create ``job_obj`` and time it. Job create is the later of the client clock just before
    `kubectl create` and the API server's creationTimestamp (whole seconds, rounded down): both
    are at or before the real moment, so a figure is never under-reported."""
    ns, job = job_obj["metadata"]["namespace"], job_obj["metadata"]["name"]
    t_client = time.time()
    kube.create(job_obj)
    t_create = max(t_client, ts(kube.get("job", job, ns)["metadata"]["creationTimestamp"]))
    wait_complete(kube, ns, job)
    pod = pods_of(kube, ns, job)[0]
    summary = summary_of(pod)
    init = next(c for c in pod["status"]["initContainerStatuses"] if c["name"] == w.INIT_NAME)
    term = init["state"]["terminated"]
    train = next(c for c in pod["status"]["containerStatuses"] if c["name"] == w.TRAIN_CONTAINER)
    log = kube.logs(pod["metadata"]["name"], ns, w.TRAIN_CONTAINER)
    m = re.search(r"TRAIN_START ([0-9.]+)", log)
    assert m, log
    t_train = float(m.group(1))
    assert t_train > t_create
    return {
        "job": job,
        "node": pod["spec"].get("nodeName"),
        "job_create": round(t_create, 3),
        "pod_create_after_s": round(ts(pod["metadata"]["creationTimestamp"]) - t_create, 3),
        "init_start_after_s": round(ts(term["startedAt"]) - t_create, 3),
        "init_end_after_s": round(ts(term["finishedAt"]) - t_create, 3),
        "copy_seconds": summary["seconds"],
        "copied_bytes": summary["fetched_bytes"],
        "warm": bool(summary.get("warm")),
        "objects": summary["objects"],
        "training_container_started_at_after_s": round(ts(train["state"]["terminated"]["startedAt"]) - t_create, 3),
        "training_start_after_s": round(t_train - t_create, 3),
        "overhead_s": round((t_train - t_create) - summary["seconds"], 3),
    }


def measure_baseline(
    kube: Any, job_obj: dict[str, Any], node: str, pods_of: Any, timeout: float = 180
) -> dict[str, Any]:
    """The same Job without dscache: ``job_obj`` as given (no dscache.io/cache annotation, so
    the webhook's match conditions leave it alone), pinned to ``node``, timed from create to the
    training program's first line exactly as ``measure`` times it. The program then stops at its
    first check (no DSCACHE_DIR: nothing was injected), which is the proof it ran without dscache;
    the Job fails, which is expected and not waited on beyond its container's end."""
    from support.kube import wait_for

    ns, job = job_obj["metadata"]["namespace"], job_obj["metadata"]["name"]
    annotations = {
        **(job_obj["metadata"].get("annotations") or {}),
        **(job_obj["spec"]["template"]["metadata"].get("annotations") or {}),
    }
    assert not any(k.startswith("dscache.io/") for k in annotations), annotations
    job_obj["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    t_client = time.time()
    kube.create(job_obj)
    t_create = max(t_client, ts(kube.get("job", job, ns)["metadata"]["creationTimestamp"]))

    def ended() -> dict[str, Any] | None:
        for pod in pods_of(kube, ns, job):
            for c in (pod.get("status") or {}).get("containerStatuses") or []:
                if c["name"] == w.TRAIN_CONTAINER and (c.get("state") or {}).get("terminated"):
                    return pod
        return None

    pod = wait_for(
        f"the baseline Job {ns}/{job}'s training container to end",
        ended,
        timeout=timeout,
        describe=lambda: kube.kubectl("describe", "pods", "-n", ns, "-l", f"job-name={job}", check=False).stdout[
            -3000:
        ],
    )
    assert not (pod["spec"].get("initContainers") or []), "the baseline pod was injected"
    assert pod["spec"]["nodeName"] == node, pod["spec"]["nodeName"]
    train = next(c for c in pod["status"]["containerStatuses"] if c["name"] == w.TRAIN_CONTAINER)
    log = kube.logs(pod["metadata"]["name"], ns, w.TRAIN_CONTAINER)
    m = re.search(r"TRAIN_START ([0-9.]+)", log)
    assert m, log
    assert "DSCACHE_DIR / DSCACHE_MANIFEST not set" in log, log  # it really ran without dscache
    t_train = float(m.group(1))
    assert t_train > t_create
    return {
        "job": job,
        "node": node,
        "job_create": round(t_create, 3),
        "pod_create_after_s": round(ts(pod["metadata"]["creationTimestamp"]) - t_create, 3),
        "training_container_started_at_after_s": round(ts(train["state"]["terminated"]["startedAt"]) - t_create, 3),
        "training_start_after_s": round(t_train - t_create, 3),
    }
