"""Objects the suite creates: DatasetCaches, training Jobs and Pods, the S3 dataset."""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

TRAIN_UID = 1000
TRAIN_CONTAINER = "train"
INIT_NAME = "dscache-stage"  # the injected init container (dscache_contract.STAGER_CONTAINER_NAME)
SIGNAL_DIR = "/signal"

# The "training" program: the first thing it does is print when it started;
# then it checks every file the manifest lists against the manifest (size, and
# MD5 against single-part ETags) and the whole set against what the test
# uploaded (EXPECT_DIGEST), proves it is not root and that the mount is
# read-only, and optionally waits for a go signal from the test (a file in an
# emptyDir, written with kubectl exec) so the test can look at the node while
# the pod still runs.
TRAIN_SCRIPT = r"""
import errno, hashlib, json, os, sys, time
print("TRAIN_START %.3f" % time.time(), flush=True)
def fail(msg):
    print("TRAIN_FAIL " + msg, flush=True)
    sys.exit(1)
if os.getuid() == 0 or os.geteuid() == 0:
    fail("running as root")
d = os.environ.get("DSCACHE_DIR")
m = os.environ.get("DSCACHE_MANIFEST")
if not d or not m:
    fail("DSCACHE_DIR / DSCACHE_MANIFEST not set: the webhook did not inject")
# The revision layout: the manifest and the completion marker live beside each
# other in the revision's meta dir (DSCACHE_MANIFEST), never inside DSCACHE_DIR.
if not os.path.exists(os.path.join(os.path.dirname(m), "complete")):
    fail("no completion marker next to the manifest " + m)
if os.path.exists(os.path.join(d, ".dscache")):
    fail("metadata inside the data dir " + d)
lines = []
n = total = 0
with open(m) as f:
    for line in f:
        e = json.loads(line)
        p = os.path.join(d, e["path"])
        with open(p, "rb") as fh:
            data = fh.read()
        if len(data) != e["size"]:
            fail("size of %s: %d on disk, %d in the manifest" % (p, len(data), e["size"]))
        md5 = hashlib.md5(data).hexdigest()
        etag = str(e.get("etag", "")).strip('"')
        if etag and "-" not in etag and md5 != etag:
            fail("md5 of %s: %s on disk, etag %s in the manifest" % (p, md5, etag))
        lines.append("%s %d %s" % (e["path"], len(data), hashlib.sha256(data).hexdigest()))
        n += 1
        total += len(data)
digest = hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()
want = os.environ.get("EXPECT_DIGEST")
if want and digest != want:
    fail("dataset digest %s != expected %s (%d objects, %d bytes)" % (digest, want, n, total))
# Read-only means EROFS from the kernel. Any other error (EACCES: a root-owned
# 0755 directory refuses uid 1000 even on a writable mount) proves nothing.
try:
    open(os.path.join(d, "written-by-training"), "w")
    fail("the dataset mount is writable")
except OSError as e:
    if e.errno != errno.EROFS:
        fail("writing into the dataset mount failed with %s, not EROFS: the mount is not read-only"
             % errno.errorcode.get(e.errno, e.errno))
print("VERIFIED objects=%d bytes=%d uid=%d digest=%s" % (n, total, os.getuid(), digest), flush=True)
sig = os.environ.get("WAIT_FOR")
if sig:
    deadline = time.time() + 600
    while not os.path.exists(sig):
        if time.time() > deadline:
            fail("no go signal")
        time.sleep(0.2)
print("TRAIN_DONE", flush=True)
"""


@dataclass
class Dataset:
    bucket: str
    prefix: str
    files: dict[str, bytes] = field(default_factory=dict)  # key relative to prefix -> content

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"

    @property
    def objects(self) -> int:
        return len(self.files)

    @property
    def bytes(self) -> int:
        return sum(len(v) for v in self.files.values())

    @property
    def digest(self) -> str:
        lines = [f"{k} {len(v)} {hashlib.sha256(v).hexdigest()}" for k, v in self.files.items()]
        return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


def make_files(seed: int, count: int = 48) -> dict[str, bytes]:
    """Many small files and a few larger ones, in nested directories."""
    rnd = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(count):
        size = rnd.choice([0, 1, 100, 4096, 65536, 200_000]) if i % 12 else 3 * 1024 * 1024 + i
        files[f"train/shard-{i // 10:02d}/sample-{i:04d}.bin"] = rnd.randbytes(size)
    files["labels.json"] = json.dumps({"classes": ["cat", "dog"], "seed": seed}).encode()
    files["val/odd name with spaces (1).txt"] = b"validation\n" * 100
    return files


def upload(s3: Any, ds: Dataset) -> None:
    try:
        s3.create_bucket(Bucket=ds.bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for key, data in ds.files.items():
        s3.put_object(Bucket=ds.bucket, Key=f"{ds.prefix}/{key}", Body=data)
    # Something outside the prefix that must not be staged.
    s3.put_object(Bucket=ds.bucket, Key="other/not-staged.bin", Body=b"x" * 1000)


def dataset_cache(
    name: str,
    namespace: str,
    ds: Dataset,
    endpoint: str,
    secret: str | None,
    mount_path: str = "/data",
    retention: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``extra``: more spec fields as they are (e.g. prestage, placement)."""
    source: dict[str, Any] = {"uri": ds.uri, "endpoint": endpoint, "region": "us-east-1", "addressingStyle": "path"}
    if secret:
        source["credentials"] = {"secretRef": {"name": secret}}
    spec: dict[str, Any] = {"source": source, "mountPath": mount_path}
    if retention:
        spec["retention"] = retention
    if resources:
        spec["resources"] = resources
    spec.update(extra or {})
    return {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DatasetCache",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def s3_secret(name: str, namespace: str, key_id: str, secret_key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "type": "Opaque",
        "stringData": {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret_key},
    }


def train_pod_spec(image: str, ds: Dataset | None, wait: bool = False, restart_policy: str = "Never") -> dict[str, Any]:
    env = [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}]
    if ds is not None:
        env.append({"name": "EXPECT_DIGEST", "value": ds.digest})
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if wait:
        env.append({"name": "WAIT_FOR", "value": f"{SIGNAL_DIR}/go"})
        volumes.append({"name": "signal", "emptyDir": {}})
        mounts.append({"name": "signal", "mountPath": SIGNAL_DIR})
    return {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": 2,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": TRAIN_UID,
            "runAsGroup": TRAIN_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": TRAIN_CONTAINER,
                "image": image,
                "imagePullPolicy": os.environ.get("DSCACHE_E2E_PULL_POLICY", "Never"),
                "command": ["/opt/dscache/bin/python3", "-c", TRAIN_SCRIPT],
                "env": env,
                "volumeMounts": mounts,
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "volumes": volumes,
    }


def training_job(
    name: str,
    namespace: str,
    cache: str | None,
    image: str,
    ds: Dataset | None,
    wait: bool = False,
    on_template: bool = False,
) -> dict[str, Any]:
    """A batch Job; the opt-in annotation on the Job (default) or only on its pod template."""
    annotations = {"dscache.io/cache": cache} if cache else {}
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {"e2e": "dscache"}}
    tmeta: dict[str, Any] = {"labels": {"e2e": "dscache", "job": name}}
    if on_template:
        tmeta["annotations"] = annotations
    else:
        meta["annotations"] = annotations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {"backoffLimit": 0, "template": {"metadata": tmeta, "spec": train_pod_spec(image, ds, wait)}},
    }


def bare_pod(name: str, namespace: str, cache: str, image: str, ds: Dataset, wait: bool = False) -> dict[str, Any]:
    """A Pod as a Kubeflow-style operator creates it from a replica spec's pod template:
    the annotation sits on the pod itself, no Job owns it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "e2e": "dscache",
                "training.kubeflow.org/job-name": "mnist",
                "training.kubeflow.org/replica-type": "master",
                "training.kubeflow.org/replica-index": "0",
            },
            "annotations": {"dscache.io/cache": cache},
        },
        "spec": train_pod_spec(image, ds, wait),
    }
