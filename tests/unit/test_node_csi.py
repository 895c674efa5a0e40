"""The node agent's CSI driver, with a fake mount table: the lease is the mount.

The real mount table, the gRPC sockets and csi-sanity are in tests/integration/test_node_csi.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract import WipeArgs, csi
from dscache_node import disk
from dscache_node.csi.publish import Publisher, Volume, VolumeError
from dscache_stager.wipe import wipe

from .test_node_agent import R1, make_agent, stage

UID = "0b6f1e4c-1111-4a5b-9c9d-000000000001"
UID2 = "0b6f1e4c-1111-4a5b-9c9d-000000000002"


class FakeMounter:
    """A bind mount as a symlink: stat() of the target is the source, as with a real bind."""

    def __init__(self) -> None:
        self.binds: list[tuple[str, str, bool]] = []

    def bind(self, source: str, target: str, readonly: bool) -> None:
        os.rmdir(target)
        os.symlink(source, target)
        self.binds.append((source, target, readonly))

    def unmount(self, target: str) -> None:
        os.unlink(target)
        os.mkdir(target)

    def is_mount(self, target: str) -> bool:
        return os.path.islink(target)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def kubelet(tmp_path: Path) -> Path:
    (tmp_path / "kubelet" / "pods").mkdir(parents=True)
    return tmp_path / "kubelet"


def target(kubelet: Path, uid: str = UID) -> str:
    return str(kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "dscache-data" / "mount")


def context(uid: str = UID, **extra: str) -> dict[str, str]:
    return {
        csi.ATTR_CACHE: "ds",
        csi.ATTR_REVISION: R1,
        csi.ATTR_POD_NAMESPACE: "ml",
        csi.ATTR_POD_UID: uid,
        csi.ATTR_EPHEMERAL: "true",
        **extra,
    }


def publisher(root: Path, kubelet: Path) -> tuple[Publisher, FakeMounter]:
    m = FakeMounter()
    return Publisher(str(root), str(kubelet), os.getuid(), m), m


def test_csi_stubs_regenerate():
    # The committed stubs are exactly what protoc makes of the vendored protos.
    got = subprocess.run(
        [sys.executable, "-m", "dscache_node.csi.regen", "--check"], capture_output=True, text=True, check=False
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_publish_takes_the_lease_then_mounts_and_is_idempotent(root, kubelet):
    pub, m = publisher(root, kubelet)
    v = Volume.from_context(context(), target(kubelet), readonly=False)
    pub.publish(v)
    c = contract.cache_dir(str(root), "ml", "ds")
    lease = contract.lease_path(c, R1, UID)
    assert csi.lease_mount(lease) == v.target and m.binds == [(c, v.target, False)]
    pub.publish(v)  # the kubelet asks again: nothing more happens
    assert m.binds == [(c, v.target, False)]


def test_unpublish_unmounts_then_releases_and_is_idempotent(root, kubelet):
    pub, m = publisher(root, kubelet)
    v = Volume.from_context(context(), target(kubelet), readonly=False)
    pub.publish(v)
    pub.unpublish(v.target)
    c = contract.cache_dir(str(root), "ml", "ds")
    assert not m.is_mount(v.target) and not os.path.exists(contract.lease_path(c, R1, UID))
    pub.unpublish(v.target)  # again: still fine


def test_a_wipe_never_removes_a_revision_with_a_published_volume(root, kubelet):
    c = stage(root, "ml", "ds", R1, 10)
    pub, _ = publisher(root, kubelet)
    v = Volume.from_context(context(), target(kubelet), readonly=False)
    pub.publish(v)
    # The controller asks to release the pod (its view says the pod is gone) and remove the revision.
    got = wipe(WipeArgs(cache_dir=c, root=str(root), revision=R1, release=[UID]))
    assert not got.removed and got.leases == [UID]
    assert os.path.isdir(contract.data_dir(c, R1))
    pub.unpublish(v.target)
    assert wipe(WipeArgs(cache_dir=c, root=str(root), revision=R1)).removed


def test_the_agent_never_releases_a_mount_lease_from_its_pod_view(root, kubelet):
    stage(root, "ml", "ds", R1, 10)
    agent, _ = make_agent(root, 10_000)
    pub, _ = publisher(root, kubelet)
    pub.lock = agent.lock
    pub.publish(Volume.from_context(context(), target(kubelet), readonly=False))
    agent.pods.finished = {UID: True}  # a stale view: the pod "finished"
    agent.pods.synced = True
    agent.refresh()
    (got,) = disk.scan(str(root))
    assert got.leases == (UID,)


def test_restart_reads_back_mounts_and_leases_and_invents_nothing(root, kubelet):
    pub, m = publisher(root, kubelet)
    live = Volume.from_context(context(), target(kubelet), readonly=False)
    pub.publish(live)
    # A publish cut short: its lease was written, the agent died before the mount.
    c = contract.cache_dir(str(root), "ml", "ds")
    half = contract.lease_path(c, R1, UID2)
    Path(half).write_text(csi.lease_body(UID2, R1, target(kubelet, UID2)))
    # A stager's own lease (hostPath mode) is not the driver's to judge.
    Path(contract.lease_path(c, R1, "hostpath-pod")).write_text(csi.lease_body("hostpath-pod", R1))
    fresh = Publisher(str(root), str(kubelet), os.getuid(), m)
    assert fresh.recover() == (1, 1)
    assert sorted(os.listdir(contract.lease_dir(c, R1))) == sorted([UID, "hostpath-pod"])
    fresh.unpublish(live.target)
    assert os.listdir(contract.lease_dir(c, R1)) == ["hostpath-pod"]


def test_publish_gives_the_cache_dir_to_the_stager_but_not_the_leases(root, kubelet):
    pub, _ = publisher(root, kubelet)
    pub.publish(Volume.from_context(context(), target(kubelet), readonly=False))
    c = contract.cache_dir(str(root), "ml", "ds")
    for path in (c, contract.revisions_root(c), contract.lock_path(c)):
        assert os.stat(path).st_uid == os.getuid()
    assert oct(os.stat(contract.leases_root(c)).st_mode & 0o777) == "0o755"


@pytest.mark.parametrize(
    ("ctx", "why"),
    [
        (context(**{csi.ATTR_EPHEMERAL: "false"}), "inline (ephemeral) pod volumes only"),
        ({k: v for k, v in context().items() if k != csi.ATTR_POD_UID}, "podInfoOnMount"),
        (context(**{csi.ATTR_REVISION: "../../etc"}), "is not a dscache revision id"),
        (context(**{csi.ATTR_CACHE: "../other"}), "is not a Kubernetes name"),
    ],
)
def test_a_bad_volume_is_refused_with_the_fix(ctx, why, kubelet):
    with pytest.raises(VolumeError) as e:
        Volume.from_context(ctx, target(kubelet), readonly=False)
    assert e.value.code == "INVALID_ARGUMENT" and why in str(e.value)


def test_the_namespace_is_the_kubelets_not_an_attribute(root, kubelet):
    # A pod's author may write any attribute; the namespace comes from podInfoOnMount alone.
    v = Volume.from_context(context(namespace="other"), target(kubelet), readonly=False)
    assert v.namespace == "ml"


def test_a_target_outside_the_kubelets_pods_is_refused(root, kubelet, tmp_path):
    pub, _ = publisher(root, kubelet)
    v = Volume.from_context(context(), str(tmp_path / "elsewhere"), readonly=False)
    with pytest.raises(VolumeError) as e:
        pub.publish(v)
    assert e.value.code == "INVALID_ARGUMENT"
