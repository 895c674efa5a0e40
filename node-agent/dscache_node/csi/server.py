"""The agent's two gRPC sockets: the CSI endpoint, and the registration socket the kubelet watches.

    <kubeletDir>/plugins/cache.dscache.io/csi.sock            Identity + Node (CSI)
    <kubeletDir>/plugins_registry/cache.dscache.io-reg.sock   pluginregistration.v1

The agent registers itself, rather than through node-driver-registrar: that sidecar's only
job is answering GetInfo, and here it would be one more image to build, ship, pull and
keep patched on every node; the agent already runs privileged with the kubelet's
directory, and a registration socket served by the process that serves CSI is never up
while the driver is down.
"""

from __future__ import annotations

import contextlib
import os
from concurrent import futures

import grpc

from dscache_contract import csi

from ._gen import csi_pb2_grpc, pluginregistration_pb2_grpc
from .publish import Publisher
from .services import Identity, NoController, Node, Registration


def socket_paths(kubelet_dir: str) -> tuple[str, str]:
    """(the CSI endpoint, the registration socket) under the kubelet's directory."""
    return (
        os.path.join(kubelet_dir, "plugins", csi.DRIVER, "csi.sock"),
        os.path.join(kubelet_dir, "plugins_registry", f"{csi.DRIVER}-reg.sock"),
    )


def _listen(server: grpc.Server, path: str) -> None:
    os.makedirs(os.path.dirname(path), 0o750, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket left by the agent's previous container
    server.add_insecure_port(f"unix://{path}")


def serve(kubelet_dir: str, node: str, publisher: Publisher, version: str) -> tuple[grpc.Server, Registration]:
    """Start both servers on a few threads (the kubelet calls one volume at a time per pod)."""
    endpoint, registration_socket = socket_paths(kubelet_dir)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(version), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(node, publisher), server)
    csi_pb2_grpc.add_ControllerServicer_to_server(NoController(), server)
    registration = Registration(endpoint)
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registration, server)
    # One server on both sockets: the endpoint that GetInfo names serves from the same start().
    _listen(server, endpoint)
    _listen(server, registration_socket)
    server.start()
    for path in (endpoint, registration_socket):
        os.chmod(path, 0o600)  # the kubelet is root; nothing else on the node may publish
    return server, registration
