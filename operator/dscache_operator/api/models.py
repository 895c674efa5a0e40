"""The DatasetCache API (dscache.io/v1alpha1): the single source of truth.

``crds/datasetcache.yaml`` is generated from these models by
``python -m dscache_operator.api.crdgen``; a unit test fails when the two drift.
Every field carries a description, so ``kubectl explain`` is useful.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

GROUP = "dscache.io"
VERSION = "v1alpha1"
KIND = "DatasetCache"
PLURAL = "datasetcaches"
SINGULAR = "datasetcache"
SHORT_NAMES = ["dsc"]

#: On what the webhook injects: where the pods' copy lives (a VolumeMode value).
MODE_ANNOTATION = f"{GROUP}/volume"
#: Namespace label that opts a namespace into injection.
INJECTION_LABEL = f"{GROUP}/injection"
#: Our finalizer on DatasetCaches (never on users' objects).
FINALIZER = f"{GROUP}/wipe"
#: On a DatasetCache: change its value (any string, e.g. a timestamp) to re-list
#: the source and pin a new revision now.
REFRESH_ANNOTATION = f"{GROUP}/refresh"
#: How often the source is re-listed when spec.refresh.interval is not set.
DEFAULT_REFRESH_INTERVAL = "1h"


# --- the API vocabulary (StrEnum: compares equal to, formats and serialises as its value) ---


class Phase(enum.StrEnum):
    """status.phase of a DatasetCache."""

    PENDING = "Pending"
    READY = "Ready"
    FAILED = "Failed"
    DELETING = "Deleting"


class NodeState(enum.StrEnum):
    """status.nodes[].state: what one node's copy is."""

    STAGING = "Staging"
    READY = "Ready"
    FAILED = "Failed"
    WIPED = "Wiped"


class VolumeMode(enum.StrEnum):
    """Where a pod's copy lives: node-level under cacheRoot (a CSI volume the node agent
    publishes, or a hostPath), or a per-pod emptyDir."""

    CSI = "CSI"
    HOST_PATH = "HostPath"
    EMPTY_DIR = "EmptyDir"


#: The modes whose copy is the node's, under cacheRoot: shared by the node's pods, leased,
#: budgeted, fetched once per cluster and wiped by the node agent.
NODE_MODES = frozenset({VolumeMode.CSI, VolumeMode.HOST_PATH})


class RetentionPolicy(enum.StrEnum):
    WIPE_ON_JOB_COMPLETION = "WipeOnJobCompletion"
    RETAIN_WHILE_USED = "RetainWhileUsed"


class PlacementMode(enum.StrEnum):
    """spec.placement.mode (or a pod's annotation dscache.io/placement, lower-case)."""

    PREFERRED = "Preferred"
    REQUIRED = "Required"


class PodPhase(enum.StrEnum):
    """Kubernetes' own pod phases (read, never written)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


# Kubernetes' own int-or-string (resource quantities).
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": r"^[0-9.]+([eE][-+]?[0-9]+|[mkKMGTPE]i?)?$",
        }
    ),
]
Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


class _Model(BaseModel):
    # use_enum_values: model_dump() yields plain strings for the API server.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=True)


class SecretRef(_Model):
    name: str = Field(
        description="Name of a Secret in the DatasetCache's namespace with keys "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally "
        "AWS_SESSION_TOKEN). Only the init container receives them.",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )


class Credentials(_Model):
    secretRef: SecretRef | None = Field(
        default=None,
        description="Secret holding static S3 keys. Omit for pod identity, and name the "
        "ServiceAccount in spec.source.serviceAccountName.",
    )


#: On a ServiceAccount: the IAM role its tokens are exchanged for (EKS IRSA's annotation).
ROLE_ARN_ANNOTATION = "eks.amazonaws.com/role-arn"


class Source(_Model):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_enum_values=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.serviceAccountName) && has(self.credentials) && "
                    "has(self.credentials.secretRef))",
                    "message": "set either spec.source.credentials.secretRef (static keys) or "
                    "spec.source.serviceAccountName (pod identity), not both",
                }
            ]
        },
    )
    uri: str = Field(
        description="Where the dataset lives: s3://BUCKET/PREFIX/. Everything "
        "under PREFIX is staged (after include/exclude).",
        pattern=r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$",
        max_length=1024,
    )
    endpoint: str | None = Field(
        default=None,
        description="S3 endpoint URL for S3-compatible stores (MinIO, Ceph RGW, OBS, OSS, GCS). Omit for AWS S3.",
        pattern=r"^https?://[^\s]+$",
        max_length=512,
    )
    region: str | None = Field(default=None, description="Region of the bucket, e.g. us-east-1.", max_length=64)
    addressingStyle: Literal["path", "virtual"] | None = Field(
        default=None,
        description="S3 addressing style: 'path' (http://endpoint/bucket/key) "
        "or 'virtual' (http://bucket.endpoint/key). Omit for the "
        "client's default.",
    )
    credentials: Credentials | None = Field(
        default=None,
        description="How the stager authenticates with static keys. Omit for pod identity "
        "(spec.source.serviceAccountName).",
    )
    serviceAccountName: str | None = Field(
        default=None,
        description="Pod identity: a ServiceAccount of the DatasetCache's namespace whose IAM role "
        "(annotation eks.amazonaws.com/role-arn) may list and read the bucket. The operator lists the "
        "source as that ServiceAccount (a TokenRequest, then STS AssumeRoleWithWebIdentity) to pin a "
        "revision; the training pods' stagers use their own pods' identity. Not with "
        "credentials.secretRef.",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )
    include: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Glob patterns (relative to PREFIX); when set, only matching keys are staged.",
    )
    exclude: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description="Glob patterns (relative to PREFIX) of keys never staged; exclude wins over include.",
    )

    @property
    def bucket(self) -> str:
        return self.uri[len("s3://") :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.uri[len("s3://") :].split("/", 1)
        return rest[1] if len(rest) > 1 else ""

    @property
    def secret_name(self) -> str | None:
        if self.credentials and self.credentials.secretRef:
            return self.credentials.secretRef.name
        return None

    @pydantic.model_validator(mode="after")
    def _one_identity(self) -> Source:
        # The CRD's CEL rule says the same to kubectl; this says it to the webhook and the tests.
        if self.serviceAccountName and self.secret_name:
            raise ValueError(
                "set either spec.source.credentials.secretRef (static keys) or "
                "spec.source.serviceAccountName (pod identity), not both"
            )
        return self


class Retention(_Model):
    model_config = ConfigDict(
        extra="forbid",
        use_enum_values=True,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.ttlAfterLastUse) == (self.policy == 'RetainWhileUsed')",
                    "message": "ttlAfterLastUse is required with policy RetainWhileUsed "
                    "and not allowed with WipeOnJobCompletion",
                }
            ]
        },
    )
    policy: RetentionPolicy = Field(
        default=RetentionPolicy.WIPE_ON_JOB_COMPLETION,
        description="WipeOnJobCompletion: a node's copy of a revision is wiped as soon as "
        "the workloads that used it complete or fail and no other consumer on "
        "that node holds it. RetainWhileUsed: the copy stays for later "
        "Jobs and is wiped ttlAfterLastUse after its last consumer ended. "
        "A pod uses the cache as long as its top-level owner runs: Job, JobSet, "
        "PyTorchJob, TrainJob, RayJob (or RayCluster) and Volcano Job are judged "
        "by their finished condition; pods of other owners (or none) by their "
        "own phase. A pod not yet scheduled holds its revision on every node.",
    )
    ttlAfterLastUse: str | None = Field(
        default=None,
        description="With RetainWhileUsed: how long an unused copy is kept, as a "
        "duration such as 30m, 12h or 1h30m (units s, m, h, d).",
        pattern=r"^([0-9]+[smhd])+$",
        max_length=32,
    )


class ResourceRequirements(_Model):
    requests: dict[str, Quantity] | None = Field(
        default=None, description="Minimum resources of the stager init container, e.g. {cpu: 500m, memory: 256Mi}."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, description="Maximum resources of the stager init container."
    )


class Refresh(_Model):
    interval: str = Field(
        default=DEFAULT_REFRESH_INTERVAL,
        description="How often the operator re-lists the source to pin a new revision "
        "(default 1h), as a duration such as 30m, 12h or 1h30m; 'Never' for a "
        "prefix whose objects never change (e.g. a versioned, write-once path). "
        "Jobs keep the revision they were admitted with; only new Jobs get the new "
        "one. A spec change, and a change of the annotation dscache.io/refresh, "
        "re-list at once.",
        pattern=r"^(Never|([0-9]+[smhd])+)$",
        max_length=32,
    )


class Toleration(_Model):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, description="The taint key to tolerate (empty with Exists: every taint).")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal (default).")
    value: str | None = Field(default=None, description="The taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect to tolerate (empty: every effect)."
    )
    tolerationSeconds: int | None = Field(default=None, description="With NoExecute: how long the pod stays.")


class PullSecretRef(_Model):
    """A core/v1 LocalObjectReference to an image pull Secret."""

    name: str = Field(
        description="Name of a Secret of type kubernetes.io/dockerconfigjson in the DatasetCache's namespace.",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )


class Prestage(_Model):
    nodeSelector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels a node must carry to get the current revision ahead of any Job "
        "(empty: every node that runs the dscache node agent).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints of those nodes that pre-staging may ignore (GPU nodes are usually tainted).",
    )
    nodes: int | None = Field(
        default=None,
        ge=1,
        description="How many of the matching nodes hold the revision (nodes that already hold it "
        "count first). Omit for every matching node.",
    )
    imagePullSecrets: list[PullSecretRef] = Field(
        default_factory=list,
        max_length=16,
        description="Pull secrets for the stager image on the pre-stage pods, after those the chart "
        "names (its imagePullSecrets): Secrets of this namespace, as a pod's own imagePullSecrets.",
    )


class Placement(_Model):
    mode: PlacementMode = Field(
        default=PlacementMode.PREFERRED,
        description="Preferred: pods prefer nodes that already hold their revision (node affinity "
        "with the chart's weight), and copy elsewhere when none fits. Required: pods wait for such a "
        "node instead of copying elsewhere (with spec.prestage, the nodes it fills). A pod can ask "
        "for Required itself with the annotation dscache.io/placement: required.",
    )


class DatasetCacheSpec(_Model):
    source: Source = Field(description="The S3 dataset to stage.")
    mountPath: str = Field(
        description="Absolute path where training containers see the dataset, "
        "read-only. Must not clash with another mount in the pod.",
        pattern=r"^/[^\x00]*$",
        max_length=512,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!self.split('/').exists(p, p == '..' || p == '.') && self != '/'",
                    "message": "mountPath must be an absolute path without '.' or '..' segments and not '/'",
                }
            ]
        },
    )
    retention: Retention = Field(default_factory=Retention, description="When a node's copy is wiped.")
    resources: ResourceRequirements | None = Field(
        default=None,
        description="Resources of the injected init container (defaults come from the operator's configuration).",
    )
    refresh: Refresh = Field(
        default_factory=Refresh, description="When the pinned revision of the source is re-computed."
    )
    prestage: Prestage | None = Field(
        default=None,
        description="Stage the current revision onto chosen nodes before any Job asks, and again "
        "whenever the revision changes. Pre-staged copies stay until prestage is removed or the "
        "cache is deleted (the node's byte budget may evict them while unused).",
    )
    placement: Placement = Field(
        default_factory=Placement, description="How pods are drawn to nodes that already hold their revision."
    )


class Condition(_Model):
    """A metav1.Condition."""

    type: str = Field(description="Type of condition in CamelCase, e.g. SourceReady.", max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="Status of the condition: True, False or Unknown.")
    observedGeneration: int | None = Field(
        default=None, ge=0, description="The .metadata.generation this condition was set for."
    )
    lastTransitionTime: Timestamp = Field(description="Last time the condition changed status.")
    reason: str = Field(
        description="Machine-readable CamelCase reason, e.g. NoSuchBucket, "
        "AccessDenied, EndpointUnreachable, SecretNotFound.",
        max_length=1024,
        min_length=1,
    )
    message: str = Field(default="", description="Human-readable details and the fix.", max_length=32768)


class NodeRevision(_Model):
    id: str = Field(
        description="A revision staged (or being staged) on the node, or 'legacy': a copy staged by "
        "version 1 of dscache at the top of the cache dir, removed once no pod of version 1 reads it."
    )
    consumers: int = Field(default=0, ge=0, description="Live pods on the node that hold this revision.")
    lastUsed: Timestamp | None = Field(default=None, description="When its set of consumers last changed.")
    wipedAt: Timestamp | None = Field(
        default=None,
        description="When this revision was removed from the node (kept a while so "
        "that finished pods do not bring it back).",
    )
    strayLeases: list[str] = Field(
        default_factory=list,
        max_length=200,
        description="Leases a wipe found that belong to no pod the operator can see (pods deleted "
        "while it was not looking); released by the next wipe if still unknown then.",
    )
    keptAt: Timestamp | None = Field(
        default=None,
        description="When a wipe last found this revision held by something it could not release "
        "(a lease of a live pod, or an entry that is no lease: see the node's message). The next "
        "wipe waits a few minutes unless one of strayLeases can be released by then.",
    )


class NodeStatus(_Model):
    node: str = Field(description="Node name.")
    state: NodeState = Field(
        description="Staging: an init container is copying; Ready: the copy is "
        "complete; Failed: the last copy failed (see message); Wiped: "
        "the copy was removed from the node."
    )
    volume: VolumeMode = Field(
        default=VolumeMode.HOST_PATH,
        description="CSI or HostPath: a node-level copy under the operator's cacheRoot, "
        "shared by the node's pods and wiped by its dscache-node agent (CSI: each pod's "
        "volume published by that agent, which holds the copy exactly as long as the pod "
        "mounts it); EmptyDir: a per-pod copy that the kubelet removes with the pod.",
    )
    bytes: int | None = Field(default=None, ge=0, description="Bytes of the dataset on the node.")
    objects: int | None = Field(default=None, ge=0, description="Objects of the dataset on the node.")
    seconds: float | None = Field(default=None, ge=0, description="Seconds the last copy took.")
    bucketBytes: int | None = Field(
        default=None, ge=0, description="Of the bytes the last copy fetched, those it fetched from the bucket."
    )
    peerBytes: int | None = Field(
        default=None, ge=0, description="Of the bytes the last copy fetched, those it got from other nodes."
    )
    consumers: int = Field(default=0, ge=0, description="Live pods on the node that use this cache.")
    lastUsed: Timestamp | None = Field(default=None, description="When the set of consumers on the node last changed.")
    wipedAt: Timestamp | None = Field(default=None, description="When the node's copy was last wiped.")
    message: str | None = Field(default=None, description="Details of a failure or of a wipe.", max_length=4096)
    revisions: list[NodeRevision] = Field(
        default_factory=list,
        max_length=64,
        description="Revisions staged (or being staged) on the node and not wiped yet; each is "
        "removed only when no pod holds a lease on it.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )


class RevisionStatus(_Model):
    id: str = Field(
        description="The pinned revision: r- and 20 hex digits of a sha256 over the "
        "selected listing (key, size, ETag, versionId). New pods of Jobs "
        "admitted from now on stage exactly this.",
        pattern=r"^r-[0-9a-f]{20}$",
    )
    objects: int = Field(ge=0, description="Objects in this revision.")
    bytes: int = Field(ge=0, description="Bytes in this revision.")
    listedAt: Timestamp = Field(description="When the source was listed for this revision.")
    versioned: bool = Field(
        default=False,
        description="Whether the bucket has versioning Enabled, so versionIds are part of the digest and "
        "pods keep their bytes after objects are overwritten or deleted (false: key, size and ETag).",
    )
    asOf: str | None = Field(
        default=None,
        description="Versioned buckets only: the S3 server time the revision's versions are found at "
        "(per key, the newest version not after it); the webhook records it on each pod.",
        pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$",
    )


class OwnerPin(_Model):
    uid: str = Field(description="UID of a workload (any owner in a consumer pod's ownerReferences chain).")
    kind: str = Field(description="Its kind, e.g. Job, JobSet, PyTorchJob.")
    name: str = Field(description="Its name.")
    revision: str = Field(description="The revision its pods stage; new pods it creates get the same.")
    asOf: str | None = Field(default=None, description="The revision's versions time (versioned buckets).")


class WarmRevision(_Model):
    revision: str = Field(description="A revision id.")
    nodes: int = Field(ge=0, description="Nodes whose agent reports this revision complete and verified.")


class PrestageStatus(_Model):
    wanted: int = Field(ge=0, description="Nodes that should hold the current revision.")
    ready: int = Field(ge=0, description="Of those, nodes that hold it.")
    nodes: list[str] = Field(default_factory=list, max_length=256, description="The nodes chosen (at most 256 listed).")
    message: str | None = Field(default=None, description="Why some are not ready yet.", max_length=4096)


class DatasetCacheStatus(_Model):
    phase: Phase | None = Field(
        default=None,
        description="Pending: the source is not checked yet; Ready: the source "
        "is readable; Failed: see the SourceReady condition; "
        "Deleting: node copies are being wiped. Deletion refuses every new pod "
        "that asks for this cache (including new pods of Jobs already running), "
        "waits only for pods that are still running or pending, then removes "
        "each node's copy; a Job that still needs new pods gets them refused with "
        "'is being deleted' instead of holding the deletion forever.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Conditions in the metav1.Condition shape: SourceReady (the source was listed) and "
        "Ready (the source is ready and, with spec.prestage, the chosen nodes hold the current revision; "
        "kubectl wait --for=condition=Ready dsc/NAME).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observedGeneration: int | None = Field(default=None, ge=0, description="The .metadata.generation last checked.")
    objects: int | None = Field(default=None, ge=0, description="Objects in the source (after include/exclude).")
    bytes: int | None = Field(default=None, ge=0, description="Total bytes in the source (after include/exclude).")
    size: str | None = Field(default=None, description="bytes, human-readable.")
    revision: RevisionStatus | None = Field(
        default=None, description="The revision of the source that newly admitted workloads stage."
    )
    owners: list[OwnerPin] = Field(
        default_factory=list,
        description="Live workloads using this cache and the revision each is pinned to: a pod "
        "admitted for one of them stages that revision, not a newer one.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["uid"]},
    )
    observedRefresh: str | None = Field(
        default=None, description="The value of the annotation dscache.io/refresh last acted on.", max_length=1024
    )
    readyNodes: int = Field(default=0, ge=0, description="Nodes with state Ready.")
    warm: list[WarmRevision] = Field(
        default_factory=list,
        max_length=64,
        description="Per revision, how many nodes hold it complete (their node agents' labels): "
        "the webhook draws pods of that revision to those nodes.",
    )
    prestage: PrestageStatus | None = Field(default=None, description="Pre-staging progress (spec.prestage).")
    reason: str | None = Field(default=None, description="The Ready condition's reason, for kubectl get.")
    nodes: list[NodeStatus] = Field(
        default_factory=list,
        description="Per-node state of the copy.",
        # atomic, not a map keyed by node: only the controller writes it, whole each time (a merge
        # patch replaces a list anyway), and the API server's field tracking of each entry (and of
        # each entry's revisions) is CPU that every status write of the cache pays (issue 19).
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )


class DatasetCache(_Model):
    """Stage an S3 dataset onto nodes' local disks for annotated workloads."""

    apiVersion: Literal["dscache.io/v1alpha1"] = Field(default="dscache.io/v1alpha1", description="dscache.io/v1alpha1")
    kind: Literal["DatasetCache"] = Field(default="DatasetCache", description="DatasetCache")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: DatasetCacheSpec = Field(description="What to stage and how.")
    status: DatasetCacheStatus | None = Field(default=None, description="Observed state.")


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Objects", "type": "integer", "jsonPath": ".status.objects"},
    {"name": "Size", "type": "string", "jsonPath": ".status.size"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision.id"},
    {"name": "Ready nodes", "type": "integer", "jsonPath": ".status.readyNodes"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Source", "type": "string", "jsonPath": ".spec.source.uri", "priority": 1},
    {"name": "Warm", "type": "integer", "jsonPath": ".status.warm[0].nodes", "priority": 1},
    {"name": "Prestaged", "type": "integer", "jsonPath": ".status.prestage.ready", "priority": 1},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
]


def parse_duration(text: str) -> float:
    """'1h30m' -> 5400.0 (units s, m, h, d)."""
    import re

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"([0-9]+)([smhd])", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"bad duration {text!r}")
    return float(sum(int(n) * units[u] for n, u in parts))
