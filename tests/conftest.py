from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.s3server import S3Server

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server (versitygw) for the whole test session."""
    server = S3Server(root=tmp_path_factory.mktemp("s3root")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def versioned_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A second real S3 server whose buckets can have versioning Enabled."""
    root = tmp_path_factory.mktemp("s3v")
    server = S3Server(root=root / "data", versioning_dir=root / "versions").start()
    yield server
    server.stop()


@pytest.fixture
def versioned_bucket(versioned_s3: S3Server) -> str:
    """A fresh, empty bucket with versioning Enabled."""
    name = f"v{next(_bucket_ids)}-test"
    versioned_s3.make_bucket(name, versioned=True)
    return name


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session's S3 server."""
    name = f"b{next(_bucket_ids)}-test"
    s3_server.make_bucket(name)
    return name


# --- operator integration tier: one kube-apiserver + etcd + operator per session --------

_ns_ids = itertools.count()


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory):
    """A real kube-apiserver + etcd (no kubelet, no controllers) for the session."""
    from tests.support.kubeapi import KubeAPI

    api = KubeAPI(workdir=tmp_path_factory.mktemp("kubeapi")).start()
    yield api
    api.stop()


@pytest.fixture(scope="session")
def dscache_operator(kube_api, tmp_path_factory: pytest.TempPathFactory):
    """CRD + RBAC + MutatingWebhookConfiguration installed from the repo, and
    the controller and webhook running as their own ServiceAccounts."""
    from tests.support.kubeapi import Operator

    op = Operator(kube=kube_api, workdir=tmp_path_factory.mktemp("operator")).install()
    op.start("webhook")
    op.start("controller")
    yield op
    op.stop("controller")
    op.stop("webhook")


@pytest.fixture
def opted_ns(kube_api) -> str:
    """A fresh namespace labelled dscache.io/injection=enabled."""
    return kube_api.namespace(f"ml-{next(_ns_ids)}", {"dscache.io/injection": "enabled"})


@pytest.fixture
def agents(kube_api, dscache_operator, tmp_path):
    """Node agents (dscache-node processes) this test starts, one per fake Node: ``agents.start(node)``.
    They trust the controller's ServiceAccount; all are stopped when the test ends."""
    from tests.support.nodeagent import NodeAgents

    pool = NodeAgents(kube_api, tmp_path / "agents")
    yield pool
    pool.stop_all()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A size- and inode-limited tmpfs, like a nearly full NVMe."""

    def mount(size: str, inodes: int = 10_000) -> Path:
        mnt = tmp_path / f"disk-{size}-{inodes}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(mnt)], check=True)
        mounts.append(mnt)
        return mnt

    mounts: list[Path] = []
    yield mount
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)
