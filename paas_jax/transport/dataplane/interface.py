"""The seam between the transfer protocol (Begin, Commit, Abort: gRPC messages)
and whatever carries the bytes.

Receiving side: a data plane hands every frame it reads to a ``FrameSink``
(``StateReceiver`` is one) and reports the sink's verdict back to the sender.
Sending side: ``StateSender`` asks its plane for a stream per transfer
(``open_stream``), ``put``s frames (memoryviews of the encoded objects),
``close``s and ``wait``s until the receiver acknowledged every frame; Commit
then goes over gRPC, or, on a plane that also carries control (the TCP plane's
BEGIN / COMMIT frames, ``SenderOptions.plane_control``), on its connections.
An RDMA plane (NIXL/UCX, Mooncake) would implement the same two calls:
register the encoded buffers, post one write per object into receiver
buffers announced at Begin, and deliver the (layer, key, crc32c, buffer) of
each completed write to the same ``FrameSink``; see docs/transport.md.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc


class TransferRefused(Exception):
  """The sink refuses a frame's transfer as a whole (unknown id, failed,
  budget...): ``code`` is the gRPC status the sender's transfer fails with."""

  def __init__(self, code: grpc.StatusCode, message: str):
    self.code, self.message = code, message
    super().__init__(f"{code.name}: {message}")


class FrameSink(Protocol):
  """What a receiving data plane delivers frames to (``StateReceiver``)."""

  max_frame_bytes: int

  def plane_lookup(self, transfer_id: str) -> Any:
    """The open transfer's handle. Raises TransferRefused (NOT_FOUND...)."""

  def plane_descriptor(self, handle: Any, layer: int, layer_json: str) -> None:
    """A layer descriptor arrived. Raises TransferRefused."""

  def plane_chunk(self, handle: Any, layer: int, key: str, crc32c: int, data,
                  data_crc32c: int) -> str | None:
    """A stored object arrived in ``data`` (a bytes-like buffer, now owned by
    the sink); ``crc32c`` is what the frame header says, ``data_crc32c`` what
    the plane computed over the bytes as they arrived. Returns why it was
    rejected (the sender resends it), or None when it is kept. Raises
    TransferRefused when the transfer fails."""

  def plane_bundle(self, handle: Any, label: str, crc32c: int, data,
                   data_crc32c: int) -> str | None:
    """A BUNDLE arrived: several groups' descriptors and objects in ``data``
    (layout: ``dataplane.bundle``; the buffer is now owned by the sink, which
    keeps views of it); ``label`` names it in messages. Verified and adopted
    as a whole: returns why it was rejected (the sender resends it), or None
    when it is kept. Raises TransferRefused when the transfer fails."""

  def plane_begin(self, request: bytes, peer: str, repeated: bool = False) -> bytes:
    """A serialized ``BeginRequest`` arrived (BEGIN frame); returns the
    serialized ``BeginResponse``. ``repeated``: the sender sent this BEGIN
    again after losing the connection that carried it unanswered, so the sink
    may have run it already (then it answers as it did). Raises
    TransferRefused with Begin's status."""

  def plane_commit(self, request: bytes) -> bytes:
    """A serialized ``CommitRequest`` arrived (COMMIT frame); returns the
    serialized ``CommitResponse``. Raises TransferRefused with Commit's status."""


class SenderStream(Protocol):
  """One transfer's bytes on a sending data plane (``LaneStream``)."""

  peak_bytes: int

  def put(self, item: Any) -> None: ...

  def close(self) -> None: ...

  def wait(self) -> None: ...

  def abort(self, err: Exception) -> None: ...


class DataPlaneClient(Protocol):
  """A sender's plane to one receiver (``TcpDataPlane``)."""

  def open_stream(self, port: int, transfer_id: str, *, deadline: float, on_sent,
                  on_error, lanes: int | None = None) -> SenderStream: ...

  def close(self) -> None: ...
