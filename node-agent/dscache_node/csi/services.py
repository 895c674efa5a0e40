"""The CSI Identity and Node services, and the kubelet's plugin-registration service:
thin gRPC handlers over the publisher (publish.py).

The driver is node-only and inline-only: no Controller service, no staging, no volume
stats. Every refusal says what was wrong and how to fix it.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from dscache_contract import csi

from ._gen import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from .publish import Publisher, Volume, VolumeError

log = logging.getLogger("dscache-node.csi")

#: CSI spec versions the kubelet may speak to us in (what node-driver-registrar announces).
SUPPORTED_VERSIONS = ["1.0.0"]


def _abort(context: grpc.ServicerContext, code: str, message: str) -> Any:
    context.abort(getattr(grpc.StatusCode, code), message)


class Identity(csi_pb2_grpc.IdentityServicer):  # type: ignore[misc]
    def __init__(self, version: str) -> None:
        self.version = version

    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=csi.DRIVER, vendor_version=self.version)

    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginCapabilitiesResponse()  # no Controller service: node-only

    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = csi_pb2.ProbeResponse()
        response.ready.value = True
        return response


class NoController(csi_pb2_grpc.ControllerServicer):  # type: ignore[misc]
    """No Controller service (GetPluginCapabilities says so); asked anyway for its capabilities
    (csi-sanity's node tests do), it answers: none (one UNKNOWN entry, since csi-sanity takes an
    empty list for a missing answer). Every other Controller call is UNIMPLEMENTED."""

    def ControllerGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        unknown = csi_pb2.ControllerServiceCapability.RPC(type=csi_pb2.ControllerServiceCapability.RPC.UNKNOWN)
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[csi_pb2.ControllerServiceCapability(rpc=unknown)]
        )


class Node(csi_pb2_grpc.NodeServicer):  # type: ignore[misc]
    def __init__(self, node_id: str, publisher: Publisher) -> None:
        self.node_id = node_id
        self.publisher = publisher

    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)

    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetCapabilitiesResponse()  # no staging, no stats: publish and unpublish only

    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            return _abort(context, "INVALID_ARGUMENT", "volume_id is empty")
        if not request.target_path:
            return _abort(context, "INVALID_ARGUMENT", "target_path is empty")
        if not request.HasField("volume_capability"):
            return _abort(context, "INVALID_ARGUMENT", "volume_capability is missing")
        if request.volume_capability.HasField("block"):
            return _abort(
                context, "INVALID_ARGUMENT", f"{csi.DRIVER} volumes are directories: use a mount volume, not block"
            )
        try:
            volume = Volume.from_context(dict(request.volume_context), request.target_path, request.readonly)
            self.publisher.publish(volume)
        except VolumeError as e:
            log.warning(f"NodePublishVolume {request.volume_id} at {request.target_path}: {e}")
            return _abort(context, e.code, str(e))
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            return _abort(context, "INVALID_ARGUMENT", "volume_id is empty")
        if not request.target_path:
            return _abort(context, "INVALID_ARGUMENT", "target_path is empty")
        try:
            self.publisher.unpublish(request.target_path)
        except VolumeError as e:
            log.warning(f"NodeUnpublishVolume {request.volume_id} at {request.target_path}: {e}")
            return _abort(context, e.code, str(e))
        return csi_pb2.NodeUnpublishVolumeResponse()

    def NodeStageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        return _abort(context, "UNIMPLEMENTED", f"{csi.DRIVER} has no STAGE_UNSTAGE_VOLUME capability")

    def NodeUnstageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        return _abort(context, "UNIMPLEMENTED", f"{csi.DRIVER} has no STAGE_UNSTAGE_VOLUME capability")

    def NodeGetVolumeStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return _abort(context, "UNIMPLEMENTED", f"{csi.DRIVER} has no GET_VOLUME_STATS capability")

    def NodeExpandVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        return _abort(context, "UNIMPLEMENTED", f"{csi.DRIVER} has no EXPAND_VOLUME capability")


class Registration(pluginregistration_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    """The kubelet's plugin watcher finds this socket in plugins_registry/, asks GetInfo,
    then dials the CSI endpoint and calls NodeGetInfo (what node-driver-registrar does)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.registered: bool | None = None

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pluginregistration_pb2.PluginInfo(
            type="CSIPlugin", name=csi.DRIVER, endpoint=self.endpoint, supported_versions=SUPPORTED_VERSIONS
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info(f"the kubelet registered {csi.DRIVER} at {self.endpoint}")
        else:
            log.error(f"the kubelet refused to register {csi.DRIVER}: {request.error}")
        return pluginregistration_pb2.RegistrationStatusResponse()
