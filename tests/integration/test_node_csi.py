"""The node agent's CSI driver on the real mount table: its gRPC sockets, real bind mounts,
and the CSI spec's own conformance tests (csi-sanity, built from source by tools.sh).

csi-sanity runs its Identity and Node specs, which are what a node-only, inline-only driver
has. What does not apply is skipped by csi-sanity itself (no STAGE_UNSTAGE_VOLUME,
GET_VOLUME_STATS or EXPAND_VOLUME capability) or here, with the reason: "should remove
target path" first creates a volume through a Controller service, which an inline driver
does not have; the same behaviour is checked below with a real publish.
Needs root (mount(2)); CI runs as root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import dscache_contract as contract
from dscache_contract import csi
from dscache_node.csi._gen import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from dscache_node.csi.mounts import LibcMounter, mount_points
from dscache_node.csi.publish import Publisher
from dscache_node.csi.server import serve, socket_paths

from ..support.tools import tool_bin

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root (CI runs as root)"),
]

REV = "r-" + "a" * 20
UID = "4f1c2d3e-0000-4000-8000-00000000c5c1"


class Driver:
    def __init__(self, root: Path, kubelet: Path) -> None:
        self.root, self.kubelet = root, kubelet
        self.lock = threading.RLock()
        self.publisher = Publisher(str(root), str(kubelet), 65532, LibcMounter(), self.lock)
        self.server, self.registration = serve(str(kubelet), "node-1", self.publisher, "test")
        self.endpoint, self.registration_socket = socket_paths(str(kubelet))
        self.channel = grpc.insecure_channel(f"unix://{self.endpoint}")
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=1).wait()


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    # A short base: a unix socket's path has at most 107 bytes (pytest's tmp_path is longer).
    base = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))
    root, kubelet = base / "root", base / "kubelet"
    (kubelet / "pods").mkdir(parents=True)
    root.mkdir()
    yield root, kubelet
    # Whatever a failed test left mounted goes first, so nothing under it is removed through a mount.
    for point in sorted(mount_points(), reverse=True):
        if point.startswith(str(base) + "/"):
            subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def driver(dirs: tuple[Path, Path]) -> Iterator[Driver]:
    d = Driver(*dirs)
    yield d
    d.close()


def publish_request(target: str, uid: str = UID) -> csi_pb2.NodePublishVolumeRequest:
    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER),
    )
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=f"csi-{uid}",
        target_path=target,
        volume_capability=cap,
        volume_context={
            csi.ATTR_CACHE: "ds",
            csi.ATTR_REVISION: REV,
            csi.ATTR_POD_NAMESPACE: "ml",
            csi.ATTR_POD_UID: uid,
            csi.ATTR_POD_NAME: "train-0",
            csi.ATTR_EPHEMERAL: "true",
        },
    )


def target_of(kubelet: Path, uid: str = UID) -> str:
    d = kubelet / "pods" / uid / "volumes" / "kubernetes.io~csi" / "dscache-data"
    d.mkdir(parents=True, exist_ok=True)
    return str(d / "mount")


def test_kubelet_registration(driver: Driver):
    # What the kubelet's plugin watcher asks, on the socket it finds in plugins_registry/.
    with grpc.insecure_channel(f"unix://{driver.registration_socket}") as ch:
        info = pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(pluginregistration_pb2.InfoRequest())
        assert (info.type, info.name, info.endpoint) == ("CSIPlugin", csi.DRIVER, driver.endpoint)
        assert list(info.supported_versions) == ["1.0.0"]
        pluginregistration_pb2_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(plugin_registered=True)
        )
    assert driver.registration.registered is True
    assert oct(os.stat(driver.endpoint).st_mode & 0o777) == "0o600"


def test_publish_is_a_real_bind_mount_and_the_lease_follows_it(driver: Driver):
    target = target_of(driver.kubelet)
    driver.node.NodePublishVolume(publish_request(target))
    driver.node.NodePublishVolume(publish_request(target))  # idempotent
    c = contract.cache_dir(str(driver.root), "ml", "ds")
    assert target in mount_points()
    assert csi.lease_mount(contract.lease_path(c, REV, UID)) == target
    # The pod sees C itself: what the stager writes through the volume lands in the node's copy.
    Path(target, "revs", "probe").write_text("hello")
    assert Path(c, "revs", "probe").read_text() == "hello"
    assert os.stat(c).st_uid == 65532
    driver.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"csi-{UID}", target_path=target))
    driver.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"csi-{UID}", target_path=target))
    assert target not in mount_points() and not os.path.exists(target)
    assert not os.path.exists(contract.lease_path(c, REV, UID))
    assert Path(c, "revs", "probe").read_text() == "hello"  # unpublishing removes nothing of the copy


def test_a_restarted_driver_reads_back_what_is_mounted(dirs: tuple[Path, Path]):
    root, kubelet = dirs
    first = Driver(root, kubelet)
    target = target_of(kubelet)
    first.node.NodePublishVolume(publish_request(target))
    first.close()  # the agent dies; its mount stays (it belongs to the kubelet's pod now)
    c = contract.cache_dir(str(root), "ml", "ds")
    # A publish that was cut short by the crash, after its lease, before its mount.
    half = contract.lease_path(c, REV, "dead-uid")
    Path(half).write_text(csi.lease_body("dead-uid", REV, target_of(kubelet, "dead-uid")))
    second = Driver(root, kubelet)
    try:
        assert second.publisher.recover() == (1, 1)
        assert target in mount_points() and os.path.exists(contract.lease_path(c, REV, UID))
        assert not os.path.exists(half)
        second.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target))
        assert target not in mount_points() and not os.path.exists(contract.lease_path(c, REV, UID))
    finally:
        second.close()


def test_csi_sanity(driver: Driver, tmp_path: Path):
    sanity = tool_bin("csi-sanity") / "csi-sanity"
    pod = driver.kubelet / "pods" / "sanity-pod"
    pod.mkdir()
    junit = tmp_path / "sanity.xml"
    got = subprocess.run(
        [
            str(sanity),
            "-ginkgo.no-color",
            "-ginkgo.focus",
            "Identity Service|Node Service",
            "-ginkgo.skip",
            "should remove target path",
            f"-csi.endpoint=unix://{driver.endpoint}",
            f"-csi.mountdir={pod / 'mount'}",
            f"-csi.stagingdir={pod / 'staging'}",
            f"-csi.junitfile={junit}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]
    passed = [line for line in got.stdout.splitlines() if "Passed" in line]
    assert passed and " 0 Failed" in passed[-1], passed
