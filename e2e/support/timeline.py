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
