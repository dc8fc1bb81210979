"""The old byte path of a ``Transfer``: N gRPC ``Push`` client streams draining
one byte-bounded frame queue (``SenderOptions.plane="grpc"``, or a receiver
that announces no data plane)."""

from __future__ import annotations

import threading

import grpc

from paas_jax.proto import transport_pb2
from paas_jax.transport.errors import TransferError
from paas_jax.transport.flow import ByteBoundedQueue, QueueAborted


class PushStreams:
  """gRPC Push streams of ``Transfer`` (a mixin: it relies on the transfer's
  ``_chunks``, ``_recorder``, ``_link``, ``_sender``, ``_options``, ``_calls``,
  ``_error``, ``_remaining`` and ``_abort``)."""

  def _chunk_frame(self, key: str, attempt: int) -> transport_pb2.Frame:
    layer, chunk, data = self._chunks[key]
    return transport_pb2.Frame(chunk=transport_pb2.Chunk(
        transfer_id=self.transfer_id, layer_index=layer, key=key, crc32c=chunk.crc32c,
        nbytes=chunk.nbytes, data=data, attempt=attempt))

  def _frame_iter(self, frames: ByteBoundedQueue, resend: bool):
    sent = 0
    while True:
      try:
        item = frames.get()
      except QueueAborted:
        return  # Ends without StreamEnd: the receiver treats the stream as broken.
      if item is None:
        break
      frame, layer, nbytes, is_chunk = item
      self._recorder.frame_sent(layer, nbytes, is_chunk, resend)
      sent += 1
      yield frame
      # gRPC asks for the next frame only once this one's write completed, so
      # from here its bytes count as sent (not when it was merely dequeued).
      if nbytes:
        self._link.sent_bytes(nbytes)
    yield transport_pb2.Frame(end=transport_pb2.StreamEnd(frames=sent))

  def _open_streams(self, frames: ByteBoundedQueue, *, resend: bool, count: int | None = None):
    self._calls = []
    for i in range(count or self._options.num_streams):
      call = self._sender.stub(i).Push.future(self._frame_iter(frames, resend),
                                               timeout=self._remaining())
      call.add_done_callback(self._on_stream_done)
      self._calls.append(call)

  def _on_stream_done(self, call: grpc.Future) -> None:
    # A stream that fails (receiver refused a frame, connection lost,
    # deadline) fails the transfer now: otherwise the encoder could wait
    # forever on a queue that no stream drains.
    if call.cancelled():
      return
    exc = call.exception()
    if exc is None or self._error is not None:
      return
    err = TransferError.from_rpc_error(exc, self.transfer_id, "Push stream failed")
    # Not inline: this runs on a gRPC callback thread, which must not block
    # on the Abort RPC.
    threading.Thread(target=self._abort, args=(err,), daemon=True).start()
