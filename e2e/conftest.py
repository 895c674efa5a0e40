"""Session fixtures of the end-to-end suite: a real cluster, the chart, a real bucket.

Configuration (environment; e2e/run.sh sets these):
  KUBECONFIG                    default ~/.cache/dscache/kind/kubeconfig (the kind cluster of e2e/kind/up.sh)
  DSCACHE_E2E_KUBECTL / _HELM   binaries (default: e2e/tools/tools.sh --path, else PATH)
  DSCACHE_E2E_OPERATOR_IMAGE    default localhost/dscache-operator:kind
  DSCACHE_E2E_STAGER_IMAGE      default localhost/dscache-stager:kind (also the "training" image)
  DSCACHE_E2E_PULL_POLICY       default Never (images are `kind load`ed, there is no registry)
  DSCACHE_E2E_CACHE_ROOT        the chart's cacheRoot, default /var/lib/dscache (inside each node)
  DSCACHE_E2E_S3_ENV            optional file with AWS_ENDPOINT_URL/keys (KEY=value lines); by default
                                AWS_ENDPOINT_URL etc. come from the environment (e2e/kind/up.sh), which wins
  DSCACHE_E2E_S3_ENDPOINT_POD   the endpoint as pods see it (default: AWS_ENDPOINT_URL)
  DSCACHE_E2E_NODE_EXEC         prefix to run a command on a node (kind: "docker exec <node>", or
                                "docker exec {node}" for several nodes: {node} is the pod's node);
                                empty: the node is this machine
  DSCACHE_E2E_RESULTS           directory for timeline.json (default build/)
  DSCACHE_E2E_REUSE_RELEASE=1   keep an installed release instead of reinstalling (development only)
  DSCACHE_E2E_HELM_ARGS         extra `helm install` arguments (shell words), e.g. "--set webhook.replicas=1"
  DSCACHE_E2E_MULTINODE=1       run the tests marked `multinode` (3 nodes that run pods, the JobSet and
                                Kubeflow controllers: e2e/run.sh sets it); otherwise they are
                                deselected (absent from the results), never skipped
  DSCACHE_E2E_REJOIN_CMD        shell command that rewires a node after test_node_lost brings it back
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import sts
from support import workloads as w
from support.kube import Kube, node_path_exists, wait_for

REPO = Path(__file__).resolve().parent.parent
RELEASE = "dscache"
RELEASE_NS = "dscache-system"
NS_PREFIX = "dscache-e2e-"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multinode: needs 3 nodes that run pods and the workload controllers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect multi-node tests unless the cluster has them (a skip would read as proof of nothing)."""
    drop = []
    if os.environ.get("DSCACHE_E2E_MULTINODE") != "1":
        drop = [i for i in items if i.get_closest_marker("multinode")]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def _tool(env: str, tool: str, binary: str) -> str:
    if os.environ.get(env):
        return os.environ[env]
    try:
        out = subprocess.run(
            ["bash", str(REPO / "e2e/tools/tools.sh"), "--path", tool], capture_output=True, text=True, timeout=60
        )
        lines = out.stdout.strip().splitlines()
        if out.returncode == 0 and lines and Path(lines[-1], binary).exists():
            return str(Path(lines[-1], binary))
    except (OSError, subprocess.SubprocessError):
        pass
    found = shutil.which(binary)
    if not found:
        raise RuntimeError(f"{binary} not found: set {env}")
    return found


def _s3_env() -> dict[str, str]:
    env: dict[str, str] = {}
    path = Path(os.environ.get("DSCACHE_E2E_S3_ENV", "/dev/null"))
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                env[k.strip()] = v.strip().strip('"').strip("'")
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    missing = [k for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not env.get(k)]
    if missing:
        raise RuntimeError(f"S3 settings missing ({', '.join(missing)}): is the cluster up? ({path})")
    return env


class Config:
    def __init__(self) -> None:
        self.kubeconfig = os.environ.get("KUBECONFIG", str(Path.home() / ".cache/dscache/kind/kubeconfig"))
        self.operator_image = os.environ.get("DSCACHE_E2E_OPERATOR_IMAGE", "localhost/dscache-operator:kind")
        self.stager_image = os.environ.get("DSCACHE_E2E_STAGER_IMAGE", "localhost/dscache-stager:kind")
        self.pull_policy = os.environ.get("DSCACHE_E2E_PULL_POLICY", "Never")
        self.cache_root = os.environ.get("DSCACHE_E2E_CACHE_ROOT", "/var/lib/dscache").rstrip("/")
        self.s3 = _s3_env()
        self.endpoint_pod = os.environ.get("DSCACHE_E2E_S3_ENDPOINT_POD", self.s3["AWS_ENDPOINT_URL"])
        self.results = Path(os.environ.get("DSCACHE_E2E_RESULTS", REPO / "build"))
        self.reuse = os.environ.get("DSCACHE_E2E_REUSE_RELEASE") == "1"
        self.run_id = uuid.uuid4().hex[:6]
        self.helm_args = shlex.split(os.environ.get("DSCACHE_E2E_HELM_ARGS", ""))


@pytest.fixture(scope="session")
def cfg() -> Config:
    return Config()


@pytest.fixture(scope="session")
def kube(cfg: Config) -> Kube:
    k = Kube(
        _tool("DSCACHE_E2E_KUBECTL", "kubernetes", "kubectl"), cfg.kubeconfig, _tool("DSCACHE_E2E_HELM", "helm", "helm")
    )
    wait_for(
        "a Ready node",
        lambda: any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for n in k.items("nodes")
            for c in n["status"].get("conditions", [])
        ),
        timeout=120,
    )
    return k


@pytest.fixture(scope="session")
def s3(cfg: Config):
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client(
        "s3",
        endpoint_url=cfg.s3["AWS_ENDPOINT_URL"],
        aws_access_key_id=cfg.s3["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=cfg.s3["AWS_SECRET_ACCESS_KEY"],
        region_name=cfg.s3.get("AWS_REGION", "us-east-1"),
        config=BotoConfig(s3={"addressing_style": "path"}, proxies={}, retries={"max_attempts": 5}),
    )


@pytest.fixture(scope="session")
def dataset(cfg: Config, s3) -> w.Dataset:
    """A real bucket in the cluster's S3 server, filled through its S3 API."""
    ds = w.Dataset(bucket=f"dscache-e2e-{cfg.run_id}", prefix="imagenet-mini", files=w.make_files(seed=4))
    w.upload(s3, ds)
    return ds


def _strip_stale_namespaces(kube: Kube) -> None:
    """Namespaces of earlier sessions: delete them; drop our finalizer if no operator serves it."""
    for ns in kube.items("namespaces"):
        name = ns["metadata"]["name"]
        if not name.startswith(NS_PREFIX):
            continue
        for dsc in kube.items("datasetcaches.dscache.io", namespace=name):
            kube.kubectl(
                "patch",
                "datasetcache",
                dsc["metadata"]["name"],
                "-n",
                name,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
        kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def namespaces(cfg: Config, kube: Kube) -> dict[str, str]:
    """The test namespaces, created before the chart so it can grant Secret reads there."""
    if kube.get("crd", "datasetcaches.dscache.io") is not None:
        _strip_stale_namespaces(kube)
    names = {
        "main": f"{NS_PREFIX}{cfg.run_id}",
        "baseline": f"{NS_PREFIX}{cfg.run_id}-psa",
        # Pod Security restricted: every feature through the CSI volume (test_27_csi.py).
        "restricted": f"{NS_PREFIX}{cfg.run_id}-rst",
        # Asks for the per-pod emptyDir (dscache.io/volume=emptyDir), restricted too.
        "emptydir": f"{NS_PREFIX}{cfg.run_id}-ed",
    }
    enforce = {"pod-security.kubernetes.io/enforce-version": "latest"}
    labels = {
        "main": {},
        "baseline": {"pod-security.kubernetes.io/enforce": "baseline", **enforce},
        "restricted": {"pod-security.kubernetes.io/enforce": "restricted", **enforce},
        "emptydir": {"pod-security.kubernetes.io/enforce": "restricted", "dscache.io/volume": "emptyDir", **enforce},
    }
    kube.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": names[key], "labels": {"dscache.io/injection": "enabled", **labels[key]}},
            }
            for key in names
        ]
    )
    for ns in names.values():
        kube.apply(w.s3_secret("s3-keys", ns, cfg.s3["AWS_ACCESS_KEY_ID"], cfg.s3["AWS_SECRET_ACCESS_KEY"]))
    return names


def _release_diagnosis(kube: Kube) -> str:
    """Why the operator pods are not ready: their state and the last lines of their crashed runs."""
    out = [kube.kubectl("get", "pods", "-n", RELEASE_NS, "-o", "wide", check=False).stdout]
    for pod in kube.items("pods", namespace=RELEASE_NS):
        name = pod["metadata"]["name"]
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("ready"):
                continue
            prev = kube.kubectl("logs", name, "-n", RELEASE_NS, "-c", cs["name"], "--previous", "--tail=8", check=False)
            cur = (
                prev
                if prev.returncode == 0 and prev.stdout.strip()
                else kube.kubectl("logs", name, "-n", RELEASE_NS, "-c", cs["name"], "--tail=8", check=False)
            )
            out.append(f"--- {name}/{cs['name']} (restarts {cs.get('restartCount')}):\n{cur.stdout.strip()}")
    return "\n".join(out)


def _split_image(ref: str) -> tuple[str, str]:
    repo, _, tag = ref.rpartition(":")
    if not repo or "/" in tag:
        return ref, "latest"
    return repo, tag


@pytest.fixture(scope="session")
def release(cfg: Config, kube: Kube, namespaces: dict[str, str]) -> dict[str, Any]:
    """`helm install` of charts/dscache, once per session (an earlier release is uninstalled first)."""
    installed = kube.helm("status", RELEASE, "-n", RELEASE_NS, check=False).returncode == 0
    info: dict[str, Any] = {"reused": False}
    op_repo, op_tag = _split_image(cfg.operator_image)
    st_repo, st_tag = _split_image(cfg.stager_image)
    sets = [
        f"cacheRoot={cfg.cache_root}",
        f"image.repository={op_repo}",
        f"image.tag={op_tag}",
        f"image.pullPolicy={cfg.pull_policy}",
        f"stager.image.repository={st_repo}",
        f"stager.image.tag={st_tag}",
        f"stager.image.pullPolicy={cfg.pull_policy}",
        # Faster convergence for a test run (defaults: 10 s and 60 s).
        "controller.reconcileIntervalSeconds=2",
        "sourceCheck.retryIntervalSeconds=5",
        "sourceCheck.secretNamespaces={" + ",".join(namespaces.values()) + "}",
        # Pod identity's STS: the checking one test_11_identity.py runs in the main namespace.
        f"podIdentity.stsEndpoint={sts.endpoint(namespaces['main'])}",
    ]
    chart = [
        RELEASE,
        str(REPO / "charts/dscache"),
        "-n",
        RELEASE_NS,
        "--wait",
        *[arg for s in sets for arg in ("--set", s)],
        *cfg.helm_args,
    ]
    if installed and cfg.reuse:
        kube.helm("upgrade", *chart, "--timeout", "300s")
        info["reused"] = True
    else:
        if installed:
            kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "180s")
        kube.kubectl("create", "namespace", RELEASE_NS, check=False)
        # The node agents mount a hostPath and use the host network: the release namespace stays privileged.
        kube.kubectl("label", "namespace", RELEASE_NS, "--overwrite", "pod-security.kubernetes.io/enforce=privileged")
        t0 = time.monotonic()
        try:
            p = kube.helm("install", *chart, "--timeout", "180s")
        except Exception as e:
            raise RuntimeError(f"helm install failed: {e}\n{_release_diagnosis(kube)}") from None
        info["install_seconds"] = round(time.monotonic() - t0, 1)
        info["output"] = p.stdout
    yield info
    # Leave the release installed (inspect it with kubectl); delete our namespaces while
    # the controller still runs, so it wipes every copy and releases its finalizers.
    for ns in namespaces.values():
        kube.kubectl("delete", "jobs,pods", "--all", "-n", ns, "--wait=false", check=False)
        kube.kubectl("delete", "datasetcaches", "--all", "-n", ns, "--wait=false", check=False)
    for ns in namespaces.values():
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def cache_factory(cfg: Config, kube: Kube, release, namespaces, dataset) -> Callable[..., dict]:
    """Create a DatasetCache over the session's bucket and wait until it is Ready."""
    counter = iter(range(1000))

    def make(
        prefix: str = "ds",
        namespace: str | None = None,
        retention: dict | None = None,
        secret: str | None = "s3-keys",
        ready: bool = True,
        ds: w.Dataset | None = None,
        extra: dict | None = None,
    ) -> dict:
        ns = namespace or namespaces["main"]
        name = f"{prefix}-{next(counter)}"
        kube.apply(w.dataset_cache(name, ns, ds or dataset, cfg.endpoint_pod, secret, retention=retention, extra=extra))
        if ready:
            wait_for(
                f"DatasetCache {ns}/{name} phase Ready",
                lambda: cache_status(kube, ns, name).get("phase") == "Ready",
                timeout=60,
                describe=lambda: json.dumps(cache_status(kube, ns, name), indent=1),
            )
        return {"name": name, "namespace": ns}

    return make


# --- helpers the tests share --------------------------------------------------------------


def cache_status(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    obj = kube.get("datasetcache", name, ns) or {}
    return obj.get("status") or {}


CONTROLLER_SELECTOR = "app.kubernetes.io/component=controller"


def controller_pods(kube: Kube) -> list[dict[str, Any]]:
    """The controller's pods that are not being deleted (2 replicas: a leader and a standby)."""
    return [
        p
        for p in kube.items("pods", namespace=RELEASE_NS, selector=CONTROLLER_SELECTOR)
        if not p["metadata"].get("deletionTimestamp")
    ]


def lease_holder(kube: Kube) -> str | None:
    """The pod that holds the controller's leader-election Lease (its name is its identity)."""
    lease = kube.get("lease", f"{RELEASE}-controller", RELEASE_NS) or {}
    return (lease.get("spec") or {}).get("holderIdentity") or None


def leader_pod(kube: Kube, timeout: float = 60) -> dict[str, Any]:
    """The controller pod that leads (the only one that reconciles)."""

    def find() -> dict[str, Any] | None:
        holder = lease_holder(kube)
        return next((p for p in controller_pods(kube) if p["metadata"]["name"] == holder), None)

    return wait_for("a live controller pod holding the Lease", find, timeout=timeout)


def node_entry(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    nodes = cache_status(kube, ns, name).get("nodes") or []
    return nodes[0] if nodes else {}


def job_pods(kube: Kube, ns: str, job: str) -> list[dict[str, Any]]:
    return kube.items("pods", namespace=ns, selector=f"job-name={job}")


def job_condition(kube: Kube, ns: str, job: str) -> str | None:
    obj = kube.get("job", job, ns) or {}
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return c["type"]
    return None


def describe_pods(kube: Kube, ns: str, selector: str | None = None) -> str:
    args = ["describe", "pods", "-n", ns] + (["-l", selector] if selector else [])
    out = kube.kubectl(*args, check=False).stdout
    logs = []
    for pod in kube.items("pods", namespace=ns, selector=selector):
        name = pod["metadata"]["name"]
        for c in [w.INIT_NAME, w.TRAIN_CONTAINER]:
            logs.append(f"--- logs {name} -c {c}\n{kube.logs(name, ns, c)[-3000:]}")
    return out[-6000:] + "\n" + "\n".join(logs)


def wait_job(kube: Kube, ns: str, job: str, timeout: float = 180) -> str:
    return wait_for(
        f"Job {ns}/{job} to finish",
        lambda: job_condition(kube, ns, job),
        timeout=timeout,
        describe=lambda: describe_pods(kube, ns, f"job-name={job}"),
    )


def assert_complete(kube: Kube, ns: str, job: str, timeout: float = 180) -> None:
    """Wait for the Job to finish; fail with its description, pods, logs and events unless Complete."""
    state = wait_job(kube, ns, job, timeout)
    if state != "Complete":
        detail = kube.kubectl("describe", "job", job, "-n", ns, check=False).stdout[-3000:]
        events = kube.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]
        raise AssertionError(
            f"Job {ns}/{job} {state}:\n{detail}\n{describe_pods(kube, ns, f'job-name={job}')}\n--- events\n{events}"
        )


def init_summary(pod: dict[str, Any]) -> dict[str, Any]:
    """The stager's JSON summary from the init container's termination message."""
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == w.INIT_NAME:
            term = (cs.get("state") or {}).get("terminated") or {}
            msg = (term.get("message") or "").strip()
            assert term.get("exitCode") == 0, f"stager failed: {term}"
            return json.loads(msg.splitlines()[-1])
    raise AssertionError(f"pod {pod['metadata']['name']} has no {w.INIT_NAME} init container status")


def send_go(kube: Kube, ns: str, pod: str, container: str = w.TRAIN_CONTAINER) -> None:
    """Let a training container that waits for the signal file go on."""
    kube.kubectl(
        "exec",
        pod,
        "-n",
        ns,
        "-c",
        container,
        "--",
        "/opt/dscache/bin/python3",
        "-c",
        f"open('{w.SIGNAL_DIR}/go', 'w').close()",
    )


def wait_verified(kube: Kube, ns: str, job: str, timeout: float = 120) -> dict[str, Any]:
    """Wait until the Job's pod printed VERIFIED (the training container checked the data)."""

    def verified():
        pods = job_pods(kube, ns, job)
        for p in pods:
            if "VERIFIED" in kube.logs(p["metadata"]["name"], ns, w.TRAIN_CONTAINER):
                return p
        for p in pods:
            if p.get("status", {}).get("phase") == "Failed":
                raise AssertionError(f"pod failed:\n{describe_pods(kube, ns, f'job-name={job}')}")
        return None

    return wait_for(
        f"Job {ns}/{job}'s training container to verify the data",
        verified,
        timeout=timeout,
        describe=lambda: describe_pods(kube, ns, f"job-name={job}"),
    )


def host_copy(cfg: Config, ns: str, cache: str) -> str:
    return f"{cfg.cache_root}/{ns}/{cache}"


def wait_wiped(cfg: Config, kube: Kube, ns: str, cache: str, timeout: float = 90, node: str | None = None) -> None:
    path = host_copy(cfg, ns, cache)
    wait_for(
        f"the node's copy {path} to be wiped",
        lambda: not node_path_exists(path, node),
        timeout=timeout,
        describe=lambda: (
            json.dumps(cache_status(kube, ns, cache), indent=1)
            + "\n"
            + kube.kubectl("get", "pods", "-n", RELEASE_NS, "-o", "wide", check=False).stdout
        ),
    )
