"""11. Node copies are immutable revisions (issue 7), on a real cluster.

- test_snapshot_isolation: a reader keeps re-hashing its revision while the bucket
  changes and a second Job stages the new revision beside it on the same node.
- test_wipe_race: a Job is created as the wipe of its predecessor's revision is due
  (its predecessor's Job just completed, plus a random 0-2.5 s), 20 rounds in one lane
  per node at once; the node agents' logs say which rounds' wipes really ran.
- test_stage_after_wipe: a wipe runs while a pod sits in a user init container.
- test_cache_mount_read_only: a container that mounts dscache-data itself, writable.

The readers here carry their own script (READER) rather than the suite's
TRAIN_SCRIPT: they check the revision layout itself (the manifest next to a
completion marker outside DSCACHE_DIR, and a data dir holding exactly the
manifest's files), and can keep reading for a while.
"""

from __future__ import annotations

import copy
import json
import random
import re
import threading
import time
import traceback
from collections import Counter
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import (
    assert_complete,
    cache_status,
    describe_pods,
    host_copy,
    init_summary,
    job_condition,
    job_pods,
    send_go,
)
from support import agent
from support import workloads as w
from support.kube import NodeExecError, node_path_exists, schedulable_nodes, wait_for

REVISION_ANNOTATION = "dscache.io/revision"  # dscache_contract.ANNOTATION_REVISION

READER = r"""
import hashlib, json, os, sys, time
d, m = os.environ["DSCACHE_DIR"], os.environ["DSCACHE_MANIFEST"]
rev = os.environ.get("DSCACHE_REVISION", "")
print("READER_START revision=%s %.3f" % (rev, time.time()), flush=True)
def fail(msg):
    print("READER_FAIL " + msg, flush=True)
    sys.exit(1)
if not os.path.exists(os.path.join(os.path.dirname(m), "complete")):
    fail("no completion marker next to the manifest " + m)
entries = [json.loads(l) for l in open(m)]
on_disk = set()
for root, dirs, files in os.walk(d):
    for f in files:
        on_disk.add(os.path.relpath(os.path.join(root, f), d))
if on_disk != {e["path"] for e in entries}:
    fail("the data dir is not exactly the manifest: extra %s, missing %s" % (
        sorted(on_disk - {e["path"] for e in entries})[:5], sorted({e["path"] for e in entries} - on_disk)[:5]))
def check():
    bad = missing = 0
    lines = []
    for e in entries:
        p = os.path.join(d, e["path"])
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            missing += 1
            continue
        etag = e["etag"].strip('"')
        if len(data) != e["size"] or ("-" not in etag and hashlib.md5(data).hexdigest() != etag):
            bad += 1
        lines.append("%s %d %s" % (e["path"], len(data), hashlib.sha256(data).hexdigest()))
    return bad, missing, hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()
bad, missing, digest = check()
print("VERIFIED revision=%s objects=%d mismatches=%d missing=%d digest=%s" % (rev, len(entries), bad, missing, digest),
      flush=True)
if bad or missing:
    fail("mismatches=%d missing=%d" % (bad, missing))
want = os.environ.get("EXPECT_DIGEST")
if want and digest != want:
    fail("dataset digest %s != expected %s" % (digest, want))
seconds = float(os.environ.get("HAMMER_SECONDS", "0"))
if seconds:
    rounds = total_bad = total_missing = 0
    end = time.time() + seconds
    while time.time() < end:
        b, mi, _ = check()
        rounds += 1
        total_bad += b
        total_missing += mi
        if b or mi:
            print("ROUND %d mismatches=%d missing=%d" % (rounds, b, mi), flush=True)
    print("ISOLATION rounds=%d mismatches=%d missing=%d" % (rounds, total_bad, total_missing), flush=True)
    if total_bad or total_missing:
        fail("isolation broken")
sig = os.environ.get("WAIT_FOR")
if sig:
    deadline = time.time() + 600
    while not os.path.exists(sig):
        if time.time() > deadline:
            fail("no go signal")
        time.sleep(0.2)
print("READER_DONE", flush=True)
"""

POKE = r"""
import errno, os, sys
where = sys.argv[1]
results = []
for what, fn in (("create", lambda p: open(p, "w").close()), ("mkdir", os.mkdir)):
    p = os.path.join(where, "poked-by-%s-%s" % (os.environ.get("WHO", "x"), what))
    try:
        fn(p)
        results.append("WRITABLE %s %s" % (what, p))
    except OSError as e:
        results.append(("EROFS_OK %s" if e.errno == errno.EROFS else "OTHER_ERRNO %s " + errno.errorcode.get(e.errno, "?")) % what)
print(" | ".join(results), flush=True)
sys.exit(0 if all(r.startswith("EROFS_OK") for r in results) else 1)
"""


def reader_job(
    name: str,
    ns: str,
    cache: str,
    image: str,
    *,
    expect: str | None = None,
    hammer: float = 0,
    wait: bool = False,
    node: str | None = None,
    init_sleep: float = 0,
) -> dict[str, Any]:
    job = w.training_job(name, ns, cache, image, None, wait=wait)
    spec = job["spec"]["template"]["spec"]
    c = spec["containers"][0]
    c["command"] = ["/opt/dscache/bin/python3", "-c", READER]
    if expect:
        c["env"].append({"name": "EXPECT_DIGEST", "value": expect})
    if hammer:
        c["env"].append({"name": "HAMMER_SECONDS", "value": str(hammer)})
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if init_sleep:
        spec["initContainers"] = [
            {
                "name": "sleeper",
                "image": image,
                "imagePullPolicy": c["imagePullPolicy"],
                "command": ["/opt/dscache/bin/python3", "-c", f"import time; time.sleep({init_sleep})"],
                "securityContext": copy.deepcopy(c["securityContext"]),
            }
        ]
    return job


def current_revision(kube, ns: str, name: str) -> str | None:
    return (cache_status(kube, ns, name).get("revision") or {}).get("id")


def refresh(kube, ns: str, name: str, old: str) -> str:
    """Ask the operator to re-list now (annotation dscache.io/refresh) and wait for a new revision."""
    kube.kubectl("annotate", "datasetcache", name, "-n", ns, "--overwrite", f"dscache.io/refresh={time.time()}")
    return wait_for(
        f"DatasetCache {ns}/{name} to pin a revision other than {old}",
        lambda: (r := current_revision(kube, ns, name)) and r != old and r,
        timeout=90,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )


def pod_of(kube, ns: str, job: str) -> dict[str, Any]:
    return wait_for(f"a pod of Job {ns}/{job}", lambda: (job_pods(kube, ns, job) or [None])[0], timeout=60)


def logs(kube, ns: str, pod: dict[str, Any]) -> str:
    return kube.logs(pod["metadata"]["name"], ns, w.TRAIN_CONTAINER)


def mutated(ds: w.Dataset, overwrite: str, delete: str) -> w.Dataset:
    files = dict(ds.files)
    files[overwrite] = b"version two of " + overwrite.encode() + b"\n" * 50
    del files[delete]
    return w.Dataset(bucket=ds.bucket, prefix=ds.prefix, files=files)


def record(cfg, test: str, figures: dict[str, Any]) -> None:
    """Keep what a test saw in <results>/snapshots.json (pytest captures stdout; the note needs numbers)."""
    path = cfg.results / "snapshots.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[test] = figures
    cfg.results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def own_dataset(cfg, s3, tag: str, seed: int) -> w.Dataset:
    """A prefix of the session bucket for this test alone: it is changed underneath the Jobs."""
    ds = w.Dataset(
        bucket=f"dscache-e2e-{cfg.run_id}", prefix=f"{tag}-{cfg.run_id}", files=w.make_files(seed=seed, count=24)
    )
    w.upload(s3, ds)
    return ds


@pytest.mark.timeout(600)
def test_snapshot_isolation(cfg, kube, s3, cache_factory, dataset):
    ds = own_dataset(cfg, s3, "snap-iso", 21)
    cache = cache_factory("iso", ds=ds, retention={"policy": "RetainWhileUsed", "ttlAfterLastUse": "10m"})
    ns, name = cache["namespace"], cache["name"]
    rev_a = wait_for("a pinned revision", lambda: current_revision(kube, ns, name), timeout=30)

    kube.create(reader_job("iso-a", ns, name, cfg.stager_image, expect=ds.digest, hammer=120))
    pod_a = wait_for(
        "Job A reading its copy",
        lambda: next((p for p in job_pods(kube, ns, "iso-a") if "VERIFIED" in logs(kube, ns, p)), None),
        timeout=120,
        describe=lambda: describe_pods(kube, ns, "job-name=iso-a"),
    )
    node = pod_a["spec"]["nodeName"]
    assert pod_a["metadata"]["annotations"][REVISION_ANNOTATION] == rev_a

    # While A reads: one object overwritten, one deleted; the operator pins the new revision.
    overwrite, delete = "labels.json", "val/odd name with spaces (1).txt"
    ds2 = mutated(ds, overwrite, delete)
    s3.put_object(Bucket=ds.bucket, Key=f"{ds.prefix}/{overwrite}", Body=ds2.files[overwrite])
    s3.delete_object(Bucket=ds.bucket, Key=f"{ds.prefix}/{delete}")
    rev_b = refresh(kube, ns, name, rev_a)

    kube.create(reader_job("iso-b", ns, name, cfg.stager_image, expect=ds2.digest, node=node))
    assert_complete(kube, ns, "iso-b")
    pod_b = job_pods(kube, ns, "iso-b")[0]
    assert pod_b["spec"]["nodeName"] == node
    assert pod_b["metadata"]["annotations"][REVISION_ANNOTATION] == rev_b
    b = init_summary(pod_b)
    assert (b["revision"], b["warm"]) == (rev_b, False), b
    assert f"VERIFIED revision={rev_b}" in logs(kube, ns, pod_b)
    # Side by side on the node while A still reads its own.
    c = host_copy(cfg, ns, name)
    assert job_condition(kube, ns, "iso-a") is None, "Job A ended before B was checked"
    assert node_path_exists(f"{c}/revs/{rev_a}/meta/complete", node=node) and node_path_exists(
        f"{c}/revs/{rev_b}/meta/complete", node=node
    )

    assert_complete(kube, ns, "iso-a", timeout=240)
    out = logs(kube, ns, job_pods(kube, ns, "iso-a")[0])
    m = re.search(r"ISOLATION rounds=(\d+) mismatches=(\d+) missing=(\d+)", out)
    assert m, out[-2000:]
    rounds, mismatches, missing = map(int, m.groups())
    record(
        cfg,
        "test_snapshot_isolation",
        {
            "revision_a": rev_a,
            "revision_b": rev_b,
            "a_rounds": rounds,
            "a_mismatches": mismatches,
            "a_missing": missing,
        },
    )
    assert rounds >= 2 and mismatches == 0 and missing == 0


def _wipes(kube, node: str, ns: str, name: str) -> list[tuple[str, list[str], str]]:
    """The wipes the agent on ``node`` ran for one cache, from its log: (what, released UIDs, outcome)."""
    out = []
    for m in re.finditer(
        rf"wipe {re.escape(ns)}/{re.escape(name)} (.+?) release=(\S+): (\w+)", agent.agent_log(kube, node)
    ):
        out.append((m.group(1), [] if m.group(2) == "-" else m.group(2).split(","), m.group(3)))
    return out


class _Poller:
    """A daemon thread that calls ``poll()`` every ``interval`` seconds inside a ``with`` block."""

    interval = 0.2

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(self.interval)

    def poll(self) -> None:
        raise NotImplementedError


class ReadyMonitor(_Poller):
    """Samples the status; a node shown Ready with a held revision must have that revision on disk.

    A violation counts only if the status did not change while the disk was
    checked (same resourceVersion before and after), so a status that is just
    being updated is not blamed.
    """

    def __init__(self, cfg, kube, ns: str, name: str) -> None:
        super().__init__()
        self.kube, self.ns, self.name = kube, ns, name
        self.path = host_copy(cfg, ns, name)
        self.samples = self.ready_samples = 0
        self.checked: Counter[str] = Counter()  # per node: Ready samples whose copy was looked at
        self.violations: list[str] = []
        self.exec_errors: list[str] = []

    def poll(self) -> None:
        try:
            self._sample()
        except NodeExecError as e:
            # Not being able to look at the node is a broken test, never "no evidence".
            self.exec_errors.append(str(e))
        except Exception:
            pass

    def _sample(self) -> None:
        obj = self.kube.get("datasetcache", self.name, self.ns) or {}
        rv = obj.get("metadata", {}).get("resourceVersion")
        held = [
            (n["node"], r["id"])
            for n in (obj.get("status") or {}).get("nodes") or []
            if n.get("state") == "Ready"
            for r in n.get("revisions") or []
            if r.get("consumers", 0) > 0 and not r.get("wipedAt")
        ]
        self.samples += 1
        if not held:
            return
        missing = [
            (node, r) for node, r in held if not node_path_exists(f"{self.path}/revs/{r}/meta/complete", node=node)
        ]
        self.ready_samples += 1  # counted only once the disk was really looked at
        self.checked.update(node for node, _ in held)
        if missing:
            again = self.kube.get("datasetcache", self.name, self.ns) or {}
            if again.get("metadata", {}).get("resourceVersion") == rv:
                self.violations.append(f"Ready with consumers but {missing} missing (rv {rv})")


@pytest.mark.timeout(1500)
def test_wipe_race(cfg, kube, cache_factory, dataset):
    """Job 1 completes; Job 2 (same cache, same node) is created as Job 1's wipe is due:
    when Job 1's Job is Complete, plus a random 0-2.5 s, so that over 20 rounds the node
    agent's wipe (released lease, then removal if no lease is left, under the stagers'
    flock) lands before, during and after Job 2's stager takes its lease. One lane per node
    at once: the race is per node (wipes and leases are), and lanes on different nodes also
    race each other's status updates on the one cache. Whatever the order, every reader
    verifies its data and no node is shown Ready without its copy; the agents' logs say how
    many rounds' wipes really ran (removed or kept)."""
    cache = cache_factory("race")
    ns, name = cache["namespace"], cache["name"]
    rounds = 20
    nodes = schedulable_nodes(kube)[:3]
    assert nodes, "no schedulable node"
    reader_failures: list[str] = []
    warm: list[bool] = []
    released: dict[str, list[str]] = {}  # node -> pod UIDs of Job 1s whose round should have had a wipe
    stop = threading.Event()  # set once any lane failed: the others end at their next round
    rnd = random.Random(7)

    def lane(node: str, round_ids: list[int]) -> None:
        for i in round_ids:
            if stop.is_set():
                return
            j1, j2 = f"race-{i}-a", f"race-{i}-b"
            kube.create(reader_job(j1, ns, name, cfg.stager_image, expect=dataset.digest, node=node))
            uid = pod_of(kube, ns, j1)["metadata"]["uid"]
            wait_for(
                f"Job {j1} to finish",
                lambda j1=j1: job_condition(kube, ns, j1),
                timeout=180,
                interval=0.1,
                describe=lambda j1=j1: describe_pods(kube, ns, f"job-name={j1}"),
            )
            time.sleep(rnd.uniform(0, 2.5))
            kube.create(reader_job(j2, ns, name, cfg.stager_image, expect=dataset.digest, node=node))
            released.setdefault(node, []).append(uid)
            for job in (j1, j2):
                state = wait_for(
                    f"Job {job}",
                    lambda job=job: job_condition(kube, ns, job),
                    timeout=180,
                    describe=lambda job=job: describe_pods(kube, ns, f"job-name={job}"),
                )
                if state != "Complete":
                    reader_failures.append(f"{job}: {describe_pods(kube, ns, f'job-name={job}')[-1500:]}")
                elif job == j2:
                    warm.append(bool(init_summary(job_pods(kube, ns, j2)[0])["warm"]))
            kube.kubectl("delete", "job", j1, j2, "-n", ns, "--wait=false", "--cascade=background")

    with (
        ReadyMonitor(cfg, kube, ns, name) as monitor,
        ThreadPoolExecutor(len(nodes), "race-lane") as pool,
    ):
        lanes = {pool.submit(lane, node, list(range(k, rounds, len(nodes)))): node for k, node in enumerate(nodes)}
        try:
            futures.wait(lanes, return_when=futures.FIRST_EXCEPTION)
        finally:
            stop.set()  # also on a pytest timeout: no lane starts another round
    # Every lane's exception, not just the first one's (the pool has joined them all); the
    # head of the message says what was awaited, the last frames where.
    lane_errors = [
        f"lane {node}: {type(e).__name__}: {str(e)[:4000]}\n{''.join(traceback.format_tb(e.__traceback__)[-2:])}"
        for f, node in lanes.items()
        if (e := f.exception()) is not None
    ]
    wiped = Counter()
    for node, uids in released.items():
        for _what, uids_released, outcome in _wipes(kube, node, ns, name):
            if set(uids_released) & set(uids):
                wiped[outcome] += 1
    unchecked = [n for n in nodes if not monitor.checked[n]]
    record(
        cfg,
        "test_wipe_race",
        {
            "rounds": rounds,
            "lanes": nodes,
            "lane_errors": len(lane_errors),
            "wipes_releasing_job1": dict(wiped),
            "second_job_warm": sum(warm),
            "second_job_restaged": len(warm) - sum(warm),
            "reader_failures": len(reader_failures),
            "status_samples": monitor.samples,
            "ready_samples_checked_on_disk": monitor.ready_samples,
            "ready_checks_per_node": dict(monitor.checked),
            "ready_while_missing": len(monitor.violations),
        },
    )
    problems = (
        lane_errors
        + reader_failures
        + monitor.violations
        + monitor.exec_errors[:3]
        + ([] if sum(wiped.values()) else ["no round's wipe ran at all: the race was never run"])
        + ([f"no Ready sample of nodes {unchecked} was checked on disk"] if unchecked else [])
    )
    assert not problems, "\n\n".join(problems)


@pytest.mark.timeout(600)
def test_stage_after_wipe(cfg, kube, s3, cache_factory, dataset):
    """A wipe runs on the node while a pod of the same cache sits in its user init container.

    The design puts the stager first, before any user init container, so the
    pod's lease exists before the sleep; what the wipe may take is the revision
    nobody holds any more. Here Job 1 holds revision 1, the bucket changes, pod
    P (revision 2) stages and then sleeps in its init container while Job 1
    ends and revision 1 is wiped. P must then train on revision 2, whole.
    """
    ds = own_dataset(cfg, s3, "snap-saw", 31)
    cache = cache_factory("saw", ds=ds)
    ns, name = cache["namespace"], cache["name"]
    c = host_copy(cfg, ns, name)
    rev1 = wait_for("a pinned revision", lambda: current_revision(kube, ns, name), timeout=30)

    kube.create(reader_job("saw-1", ns, name, cfg.stager_image, expect=ds.digest, wait=True))
    pod1 = wait_for(
        "Job 1 reading revision 1",
        lambda: next((p for p in job_pods(kube, ns, "saw-1") if "VERIFIED" in logs(kube, ns, p)), None),
        timeout=120,
        describe=lambda: describe_pods(kube, ns, "job-name=saw-1"),
    )
    node = pod1["spec"]["nodeName"]

    ds2 = mutated(ds, "labels.json", "val/odd name with spaces (1).txt")
    s3.put_object(Bucket=ds.bucket, Key=f"{ds.prefix}/labels.json", Body=ds2.files["labels.json"])
    s3.delete_object(Bucket=ds.bucket, Key=f"{ds.prefix}/val/odd name with spaces (1).txt")
    rev2 = refresh(kube, ns, name, rev1)

    kube.create(reader_job("saw-2", ns, name, cfg.stager_image, expect=ds2.digest, node=node, init_sleep=60))

    def sleeping() -> dict | None:
        pod = pod_of(kube, ns, "saw-2")
        st = {s["name"]: s for s in (pod.get("status") or {}).get("initContainerStatuses") or []}
        stager, sleeper = st.get(w.INIT_NAME, {}), st.get("sleeper", {})
        if (stager.get("state") or {}).get("terminated", {}).get("exitCode") not in (None, 0):
            raise AssertionError(f"the stager failed: {stager}")
        return pod if "running" in (sleeper.get("state") or {}) else None

    wait_for(
        "pod P staged and sleeping in its init container",
        sleeping,
        timeout=120,
        describe=lambda: describe_pods(kube, ns, "job-name=saw-2"),
    )
    assert node_path_exists(f"{c}/revs/{rev2}/meta/complete", node=node)

    send_go(kube, ns, pod1["metadata"]["name"])
    assert_complete(kube, ns, "saw-1")

    def rev1_wiped() -> bool:
        removed = [w_ for w_ in _wipes(kube, node, ns, name) if w_[0] == rev1 and w_[2] == "removed"]
        return bool(removed) and not node_path_exists(f"{c}/revs/{rev1}", node=node)

    wait_for(
        f"revision {rev1} wiped on {node}",
        rev1_wiped,
        timeout=90,
        interval=0.2,
        describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
    )
    # The wipe ran while P was still in its init container, and took nothing P needs.
    assert sleeping() is not None, "the init container finished before the wipe: the test proved nothing"
    assert node_path_exists(f"{c}/revs/{rev2}/meta/complete", node=node) and node_path_exists(f"{c}/lock", node=node)

    assert_complete(kube, ns, "saw-2", timeout=180)
    pod2 = job_pods(kube, ns, "saw-2")[0]
    summary = init_summary(pod2)
    assert summary["revision"] == rev2
    assert f"VERIFIED revision={rev2}" in logs(kube, ns, pod2)
    record(
        cfg,
        "test_stage_after_wipe",
        {"revision_1": rev1, "revision_2": rev2, "wiped_by_agent": True, "stager_warm": summary["warm"]},
    )


def test_cache_mount_read_only(cfg, kube, cache_factory, dataset):
    """Containers that mount dscache-data themselves, without readOnly, as root: refused or EROFS."""
    cache = cache_factory("ro")
    ns, name = cache["namespace"], cache["name"]
    job = w.training_job("ro-poke", ns, name, cfg.stager_image, None)
    spec = job["spec"]["template"]["spec"]
    root = {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    main = spec["containers"][0]
    main.update({"command": ["/opt/dscache/bin/python3", "-c", POKE, "/poke"], "securityContext": root})
    main["env"].append({"name": "WHO", "value": "main"})
    main["volumeMounts"].append({"name": "dscache-data", "mountPath": "/poke"})
    spec["initContainers"] = [
        {
            "name": "poke-init",
            "image": cfg.stager_image,
            "imagePullPolicy": main["imagePullPolicy"],
            "command": ["/opt/dscache/bin/python3", "-c", POKE, "/poke-init"],
            "securityContext": root,
            "env": [{"name": "WHO", "value": "init"}],
            "volumeMounts": [{"name": "dscache-data", "mountPath": "/poke-init"}],
        }
    ]
    created = kube.create(job, check=False)
    if created.returncode != 0:
        # Refused at admission: the message must say why.
        assert "dscache-data" in created.stderr and "read" in created.stderr.lower(), created.stderr
        record(cfg, "test_cache_mount_read_only", {"outcome": "refused", "message": created.stderr.strip()})
        return
    assert_complete(kube, ns, "ro-poke")
    pod = job_pods(kube, ns, "ro-poke")[0]
    seen = {}
    for container in ("poke-init", w.TRAIN_CONTAINER):
        out = kube.logs(pod["metadata"]["name"], ns, container)
        assert "EROFS_OK create" in out and "EROFS_OK mkdir" in out, f"{container}: {out}"
        seen[container] = out.strip()
    record(cfg, "test_cache_mount_read_only", {"outcome": "EROFS", **seen})
    assert not node_path_exists(
        f"{host_copy(cfg, ns, name)}/revs/{current_revision(kube, ns, name)}/data/poked-by-main-create",
        node=pod["spec"]["nodeName"],
    )
