"""Running a ``StateReceiver``: its gRPC server and, optionally, its TCP data plane."""

from __future__ import annotations

import dataclasses
import ssl
from typing import TYPE_CHECKING, Sequence

import grpc

from paas_jax.proto import transport_pb2_grpc
from paas_jax.transport import channels
from paas_jax.transport.dataplane.server import DataPlaneServer
from paas_jax.transport.dataplane.tuning import Tuning

if TYPE_CHECKING:  # annotations only: receiver.py imports this module
  from paas_jax.transport.receiver import StateReceiver


@dataclasses.dataclass
class ReceiverServer:
  """A running gRPC server hosting a ``StateReceiver`` (and its data plane, if any)."""

  server: grpc.Server
  receiver: "StateReceiver"
  port: int
  address: str
  data_plane: DataPlaneServer | None = None

  @property
  def target(self) -> str:
    return self.address

  def stop(self, grace: float | None = 1.0) -> None:
    if self.data_plane is not None:
      self.data_plane.close()
    self.server.stop(grace).wait()
    self.receiver.close()


def serve_receiver(receiver: "StateReceiver", address: str = "127.0.0.1:0", *,
                   credentials: grpc.ServerCredentials | None = None,
                   max_workers: int = 32,
                   maximum_concurrent_rpcs: int | None = None,
                   interceptors=(), data_plane: bool = False,
                   data_ssl: ssl.SSLContext | None = None,
                   data_peers: Sequence[str] | None = None,
                   data_tuning: Tuning | None = None,
                   data_host: str | None = None,
                   data_port: int = 0,
                   data_control: bool = True) -> ReceiverServer:
  """Starts a gRPC server for ``receiver`` on ``address`` (port 0: any free port).

  ``credentials`` (e.g. ``grpc.ssl_server_credentials`` with client-cert
  checking for mTLS) secures the port; None serves plaintext. ``interceptors``
  (e.g. ``paas_jax.security.PeerIdentityInterceptor``: only prefill servers
  may push states) run before the servicer.

  ``data_plane``: also listen for the TCP data plane on the same host (any
  free port, announced in BeginResponse). ``data_ssl``
  (``dataplane.tls.server_context``) secures it, with ``data_peers`` the
  patterns the senders' certificate names must match; a TLS gRPC port with
  a plaintext data plane is refused (plaintext only behind --insecure).
  ``data_host``: bind the data plane there instead of the gRPC port's host
  (e.g. another loopback address, so that a WAN relay can listen on the
  announced port number at the host senders dial). ``data_port``: its port
  (0: any free one; a fixed one keeps a relay's route valid across restarts).
  ``data_control``: the data plane also takes Begin and Commit (announced in
  BeginResponse.data_plane_control), so senders with warm connections skip
  the gRPC round trips. Pass False when the gRPC port checks more than the
  data plane does (e.g. bearer tokens): those RPCs then stay on gRPC.
  """
  if data_plane and credentials is not None and data_ssl is None:
    raise ValueError("serve_receiver: the gRPC port uses TLS but the data plane has no "
                     "data_ssl; plaintext data planes exist only for --insecure deployments")
  server = channels.make_server(max_workers=max_workers,
                                max_message_bytes=receiver.options.max_message_bytes,
                                maximum_concurrent_rpcs=maximum_concurrent_rpcs,
                                interceptors=interceptors)
  transport_pb2_grpc.add_StateTransferServicer_to_server(receiver, server)
  port = channels.add_port(server, address, credentials)
  host = address.rsplit(":", 1)[0]
  plane = None
  if data_plane:
    plane = DataPlaneServer(receiver, data_host or host.strip("[]") or "0.0.0.0", data_port,
                            ssl_context=data_ssl, peer_patterns=data_peers,
                            tuning=data_tuning or Tuning(), control=data_control)
    receiver.data_plane_port = plane.port
    receiver.data_plane_control = data_control
  server.start()
  return ReceiverServer(server=server, receiver=receiver, port=port, address=f"{host}:{port}",
                        data_plane=plane)
