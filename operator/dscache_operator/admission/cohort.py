"""Whether a pod starts together with pods on other nodes (pure): the stager's ``--cohort``.

With peers, the first node of a revision lists the bucket and the others take its listing
(docs/fetch-once.md). The pods of a gang start within moments of each other, and each may see
only itself in its agent's first answer; with ``--cohort`` a node that sees no other looks again
a moment later before it lists, so a gang lists the bucket once. A lone pod lists at once: the
wait would only delay it. Decided at admission, from what the object itself says: a Job's
parallelism, or the labels the gang controllers put on their Jobs and pods.
"""

from __future__ import annotations

from typing import Any

#: Labels of the controllers whose pods start as a group (JobSet, and Kubeflow Trainer v2 on it;
#: the Kubeflow training-operator; LeaderWorkerSet; Volcano; KubeRay; coscheduling's PodGroup), and
#: the completion index of an Indexed Job's pod.
GANG_LABELS = (
    "jobset.sigs.k8s.io/jobset-name",
    "training.kubeflow.org/job-name",
    "leaderworkerset.sigs.k8s.io/name",
    "volcano.sh/job-name",
    "ray.io/cluster",
    "scheduling.x-k8s.io/pod-group",
    "batch.kubernetes.io/job-completion-index",
)


def starts_together(kind: str, obj: dict[str, Any]) -> bool:
    """A Job that runs more than one pod at a time, or a Job or Pod a gang controller made."""
    meta = obj.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    if kind == "Job":
        spec = obj.get("spec") or {}
        labels.update(((spec.get("template") or {}).get("metadata") or {}).get("labels") or {})
        if (spec.get("parallelism") or 1) > 1:
            return True
    return any(key in labels for key in GANG_LABELS)
