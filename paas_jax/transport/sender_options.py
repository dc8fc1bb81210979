"""What a ``StateSender`` is configured with and what a committed transfer returns."""

from __future__ import annotations

import dataclasses
import ssl
from typing import Protocol

import grpc

from paas_jax.codec.manifest import StateManifest
from paas_jax.proto import transport_pb2_grpc
from paas_jax.transport import channels
from paas_jax.transport.counters import LinkCounters
from paas_jax.transport.dataplane.tuning import Tuning, lanes_for, send_buffer_reach
from paas_jax.transport.timeline import TransferTimeline

PLANES = ("grpc", "tcp")


@dataclasses.dataclass(frozen=True)
class SenderOptions:
  """Parallelism, flow control, deadlines and retries of the sending side.

  Attributes:
    num_streams: parallel Push streams per transfer.
    num_connections: TCP connections (channels) the streams are spread over;
      ignored when channels are passed in.
    max_inflight_bytes: encoded bytes queued for the streams; encoding blocks
      beyond it.
    max_pending_layers: layers handed over but not yet encoded; ``send_layer``
      blocks beyond it (0: unbounded; the layers live on device anyway).
    max_message_bytes: gRPC message limit set on the channels.
    rpc_timeout_s: deadline of Begin and Abort.
    commit_timeout_s: deadline of Commit, which includes the receiver's final
      restore.
    transfer_timeout_s: deadline of each Push stream, from Begin.
    max_retry_rounds: resend rounds for rejected / missing chunks.
    credentials: channel credentials (mTLS); None for plaintext.
    plane: what carries the chunk bytes: "grpc" (Push streams, the old path)
      or "tcp" (the data plane, ``paas_jax.transport.dataplane``: N
      long-lived TCP connections per receiver, zero-copy frames; Begin and
      Commit ride them too with ``plane_control``). A receiver that
      announces no data-plane port gets the gRPC path.
    lanes: data-plane connections a transfer stripes over; 0: as many as
      ``tuning``'s link needs (``dataplane.tuning.lanes_for``: 1.5x its
      bandwidth-delay product over one connection's window), resolved here.
    window_bytes: unacknowledged bytes per data-plane connection.
    data_ssl: client ``ssl.SSLContext`` of the data plane
      (``dataplane.tls.client_context``); required with ``credentials``.
    tuning: data-plane socket settings (buffers from the bandwidth-delay
      product, congestion control, stall timeout).
    plane_control: with plane="tcp", send Begin and Commit over the data
      connections (BEGIN / COMMIT frames) once the receiver announced
      ``data_plane_control`` and a connection to it is warm; False: always
      over gRPC. Abort is always gRPC.
    bundle_bytes: with plane="tcp", a state whose frames add up to at most
      this many bytes (descriptors and objects) is held until ``finish`` and
      sent as one BUNDLE frame (``transport.bundler``): a tiny state's fixed
      cost is mostly per frame. Larger states stream as before. 0: never
      (a receiver older than the BUNDLE frame refuses it).
  """

  num_streams: int = 4
  num_connections: int = 1
  max_inflight_bytes: int = 32 << 20
  max_pending_layers: int = 0
  max_message_bytes: int = channels.DEFAULT_MAX_MESSAGE_BYTES
  rpc_timeout_s: float = 10.0
  commit_timeout_s: float = 120.0
  transfer_timeout_s: float = 600.0
  max_retry_rounds: int = 3
  credentials: grpc.ChannelCredentials | None = None
  plane: str = "grpc"
  lanes: int = 4
  window_bytes: int = 16 << 20
  data_ssl: ssl.SSLContext | None = None
  tuning: Tuning = Tuning()
  plane_control: bool = True
  bundle_bytes: int = 1 << 20

  def __post_init__(self):
    if self.plane not in PLANES:
      raise ValueError(f"SenderOptions.plane must be one of {PLANES}, not {self.plane!r}")
    if self.lanes < 0 or self.window_bytes < 1:
      raise ValueError("SenderOptions: lanes must be >= 0 (0: from the link) and "
                       "window_bytes >= 1")
    if self.lanes == 0:
      # Frozen: resolved once, so every reader of ``lanes`` sees a count.
      object.__setattr__(self, "lanes", lanes_for(self.tuning, self.window_bytes,
                                                  send_buffer_reach(self.tuning)))
    if self.plane == "tcp" and self.credentials is not None and self.data_ssl is None:
      raise ValueError("SenderOptions: TLS on gRPC needs data_ssl for the tcp data plane "
                       "(plaintext data planes exist only for --insecure deployments)")
    if self.num_streams < 1 or self.num_connections < 1:
      raise ValueError("SenderOptions: num_streams and num_connections must be >= 1")
    if self.max_inflight_bytes < 1:
      raise ValueError("SenderOptions.max_inflight_bytes must be >= 1")
    if self.bundle_bytes < 0:
      raise ValueError("SenderOptions.bundle_bytes must be >= 0")


@dataclasses.dataclass(frozen=True)
class TransferResult:
  """A committed transfer: the receiver holds the complete, verified state."""

  transfer_id: str
  manifest: StateManifest
  timeline: TransferTimeline


class TransferOwner(Protocol):
  """What a ``Transfer`` uses of the ``StateSender`` that opened it.

  A protocol so that ``transfer`` (and ``push_streams``) need not import
  ``sender``, which imports them.
  """

  options: SenderOptions
  counters: LinkCounters

  def stub(self, i: int) -> transport_pb2_grpc.StateTransferStub:
    """The sender's ``i``-th gRPC stub (round-robin over its channels)."""
