"""How frames reach a ``StateReceiver``: gRPC ``Push`` streams and the TCP
data plane's ``FrameSink`` calls (frames, and Begin / Commit as BEGIN /
COMMIT frames). Both end in the receiver's own verification
(``_adopt_descriptor``, ``_accept_chunk``) and ``_begin`` / ``_commit``, so
attempts, budgets, timelines and status codes are the same on either path."""

from __future__ import annotations

import time

import grpc
from google.protobuf.message import DecodeError

from paas_jax.codec import manifest as manifest_lib
from paas_jax.codec.manifest import LayerEntry
from paas_jax.proto import transport_pb2
from paas_jax.transport.bundle_ingress import accept_bundle
from paas_jax.transport.dataplane.interface import TransferRefused
from paas_jax.transport.inbound import Inbound, TransferFailed, location

Code = grpc.StatusCode


class FrameIngress:
  """Frame entry points of ``StateReceiver`` (a mixin: it relies on the
  receiver's ``_get``, ``_fail``, ``failure``, ``_begin``, ``_commit``,
  ``_adopt_descriptor``, ``_accept_chunk`` and ``options``)."""

  def Push(self, request_iterator, context):
    t: Inbound | None = None
    chunks = nbytes = frames = 0
    rejected: list[transport_pb2.ChunkStatus] = []
    ended = False
    try:
      for frame in request_iterator:
        body = frame.WhichOneof("body")
        if body == "end":
          if frame.end.frames != frames:
            raise TransferFailed(Code.DATA_LOSS, f"stream carried {frames} frames, sender says "
                                          f"{frame.end.frames}")
          ended = True
          break
        frames += 1
        msg = frame.chunk if body == "chunk" else frame.layer
        if body not in ("chunk", "layer"):
          raise TransferFailed(Code.INVALID_ARGUMENT, "empty frame")
        if t is None:
          t = self._get(msg.transfer_id)
        elif msg.transfer_id != t.info.transfer_id:
          raise TransferFailed(Code.INVALID_ARGUMENT, "one stream carries one transfer; got frames "
                                               f"of {t.info.transfer_id} and {msg.transfer_id}")
        if t.status == "failed":
          raise TransferFailed(*(self.failure(t.info.transfer_id)
                          or (Code.ABORTED, "transfer failed")))
        t.touch(time.monotonic())
        if body == "layer":
          self._on_descriptor(t, frame.layer)
        else:
          reason, size = self._on_chunk(t, frame.chunk)
          if reason is None:
            chunks += 1
            nbytes += size
          else:
            rejected.append(transport_pb2.ChunkStatus(
                layer_index=frame.chunk.layer_index, key=frame.chunk.key, reason=reason))
    except TransferFailed as e:
      if t is not None:
        self._fail(t, e.code, e.message)
      context.abort(e.code, e.message)
    except grpc.RpcError:
      # The request iterator raises when the client goes away mid-stream.
      pass
    if not ended:
      if t is not None:
        self._fail(t, Code.CANCELLED, "a Push stream ended without StreamEnd (sender died, "
                                      "was cancelled, or lost its connection)")
      context.abort(Code.CANCELLED, "stream ended without StreamEnd")
    return transport_pb2.PushSummary(chunks=chunks, bytes=nbytes, rejected=rejected)

  def _on_descriptor(self, t: Inbound, msg) -> None:
    self._adopt_descriptor(t, *_parse_descriptor(msg.layer_json, msg.layer_index),
                           msg.layer_index)

  def _on_chunk(self, t: Inbound, c) -> tuple[str | None, int]:
    """Stores a chunk if it verifies; returns (why it was rejected or None, bytes)."""
    # Every access to a protobuf bytes field copies it: read it once.
    return self._accept_chunk(t, c.layer_index, c.key, c.crc32c, c.nbytes, c.data)

  # -- data plane (paas_jax.transport.dataplane.interface.FrameSink) ------------------

  @property
  def max_frame_bytes(self) -> int:
    return self.options.max_message_bytes

  def plane_lookup(self, transfer_id: str) -> Inbound:
    try:
      t = self._get(transfer_id)
    except TransferFailed as e:
      raise TransferRefused(e.code, e.message) from None
    if t.status == "failed":
      code, message = self.failure(transfer_id) or (Code.ABORTED, "transfer failed")
      raise TransferRefused(code, message)
    return t

  def plane_descriptor(self, t: Inbound, layer: int, layer_json: str) -> None:
    t.touch(time.monotonic())
    try:
      self._adopt_descriptor(t, *_parse_descriptor(layer_json, layer), layer)
    except TransferFailed as e:
      self._fail(t, e.code, e.message)
      raise TransferRefused(e.code, e.message) from None

  def plane_chunk(self, t: Inbound, layer: int, key: str, crc: int, data,
                  data_crc: int) -> str | None:
    t.touch(time.monotonic())
    try:
      reason, _ = self._accept_chunk(t, layer, key, crc, len(data), data, data_crc)
    except TransferFailed as e:
      self._fail(t, e.code, e.message)
      raise TransferRefused(e.code, e.message) from None
    return None if reason is None else f"{location(layer, key)}: {reason}"

  def plane_bundle(self, t: Inbound, label: str, crc: int, data, data_crc: int) -> str | None:
    t.touch(time.monotonic())
    try:
      return accept_bundle(self, t, label, crc, data, data_crc)
    except TransferFailed as e:
      self._fail(t, e.code, e.message)
      raise TransferRefused(e.code, e.message) from None

  def plane_begin(self, request: bytes, peer: str, repeated: bool = False) -> bytes:
    try:
      message = transport_pb2.BeginRequest.FromString(request)
    except DecodeError as e:
      raise TransferRefused(Code.INVALID_ARGUMENT, f"BEGIN frame: not a BeginRequest: {e}")
    try:
      return self._begin(message, peer, repeated=repeated).SerializeToString()
    except TransferFailed as e:
      raise TransferRefused(e.code, e.message) from None

  def plane_commit(self, request: bytes) -> bytes:
    try:
      message = transport_pb2.CommitRequest.FromString(request)
    except DecodeError as e:
      raise TransferRefused(Code.INVALID_ARGUMENT, f"COMMIT frame: not a CommitRequest: {e}")
    try:
      return self._commit(message).SerializeToString()
    except TransferFailed as e:
      raise TransferRefused(e.code, e.message) from None


def _parse_descriptor(layer_json: str, layer: int) -> tuple[LayerEntry, tuple[dict, str]]:
  """A layer descriptor's entry and (its parsed JSON, its text). Raises TransferFailed."""
  try:
    raw = manifest_lib.loads(layer_json)
    return LayerEntry.from_dict(raw), (raw, layer_json)
  except (ValueError, KeyError, TypeError) as e:
    raise TransferFailed(Code.INVALID_ARGUMENT, f"layer {layer}: bad descriptor: {e}") from None
