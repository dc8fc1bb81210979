"""One state on its way to a decode process (``StateSender.begin`` opens it).

See ``paas_jax.transport.sender`` for the threads involved. The bytes take the
TCP data plane (a ``LaneStream`` over the sender's long-lived connections; with
``plane_control`` also Begin and Commit) or the old gRPC Push streams
(``push_streams.PushStreams``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from paas_jax.codec.encode import (EncodedGroup, build_manifest, encode_layer,
                                   encode_state_arrays)
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, ChunkEntry, LayerEntry, StateManifest
from paas_jax.codec.options import CodecOptions
from paas_jax.proto import transport_pb2
from paas_jax.transport import channels
from paas_jax.transport.bundler import Bundler, LaneCallbacks
from paas_jax.transport.dataplane import frames as plane_frames
from paas_jax.transport.dataplane.lanes import LanePool
from paas_jax.transport.dataplane.streams import LaneStream, Outgoing
from paas_jax.transport.errors import TransferError
from paas_jax.transport.flow import ByteBoundedQueue, QueueAborted
from paas_jax.transport.push_streams import PushStreams
from paas_jax.transport.sender_options import TransferOwner, TransferResult
from paas_jax.transport.timeline import TimelineRecorder, TransferTimeline

Code = grpc.StatusCode
_FINISH = object()


class Transfer(LaneCallbacks, PushStreams):
  """One state on its way to a decode process. Create with ``StateSender.begin``.

  Use as a context manager: leaving the block with an exception (e.g. the
  prefill failed) aborts the transfer on both sides.
  """

  def __init__(self, sender: TransferOwner, transfer_id: str, *, token_count: int,
               num_layers: int, model_id: str, config_fingerprint: str, codec: CodecOptions,
               max_frame_bytes: int, lengths: Any | None, batch: int,
               recorder: TimelineRecorder, pool: LanePool | None = None,
               begin_request: transport_pb2.BeginRequest | None = None):
    self.transfer_id = transfer_id
    self.token_count = token_count
    self.num_layers = num_layers
    self.model_id = model_id
    self.config_fingerprint = config_fingerprint
    self.codec = codec
    self._sender = sender
    self._options = sender.options
    self._max_frame_bytes = max_frame_bytes
    self._lengths = lengths
    self._batch = batch
    self._recorder = recorder
    self._deadline = time.monotonic() + self._options.transfer_timeout_s
    self._lock = threading.Lock()
    self._error: TransferError | None = None
    self._abort_sent = threading.Event()
    self._abort_thread: threading.Thread | None = None
    self._done = False
    self._entries: dict[int, LayerEntry] = {}
    self._entry_json: dict[int, tuple[LayerEntry, str]] = {}
    self._submitted: set[int] = set()
    self._chunks: dict[str, tuple[int, ChunkEntry, bytes]] = {}
    self._rejected: dict[str, str] = {}
    self._layers_in: queue.Queue = queue.Queue(maxsize=self._options.max_pending_layers)
    self._frames = ByteBoundedQueue(self._options.max_inflight_bytes)
    self._calls: list[grpc.Future] = []
    # This transfer's share of the link gauges of the sender's owner
    # (``StateSender.counters``): pending and sent bytes as they happen.
    self._link = sender.counters.begin(transfer_id, num_layers)
    self._pool = pool
    self._stream: LaneStream | None = None
    # Small states go as one BUNDLE frame (bundler.py); the payload must also
    # fit the receiver's frame limit.
    self._bundler = Bundler(min(self._options.bundle_bytes,
                                max_frame_bytes - channels.FRAME_OVERHEAD_BYTES))
    # Begin and Commit ride the data connections (Begin already did when set).
    self._plane_control = begin_request is not None
    self._begin_frame: Outgoing | None = None
    if pool is not None:
      try:
        self._stream = self._open_lane_stream()
      except TransferError:
        self._link.end()
        raise
      if begin_request is not None:
        # Pipelined: the frames follow BEGIN on its connection without waiting
        # for its RESULT (read before Commit; a refused Begin fails the stream
        # with Begin's status, and the frames behind it are dropped unread).
        self._begin_frame = self._stream.call_async(plane_frames.BEGIN,
                                                    begin_request.SerializeToString())
        # Written from this thread: the receiver runs Begin while the caller
        # queues the layers (a lane's writer would wait for the interpreter).
        self._stream.write_through()
    else:
      self._open_streams(self._frames, resend=False)
    # Started by the first layer to encode (send_layer); already encoded groups
    # and the state-level arrays are queued by the caller's thread itself, so
    # a transfer of pre-encoded groups pays no thread hand-off for them.
    self._encoder: threading.Thread | None = None
    self._enqueue_lock = threading.Lock()

  # -- public API ------------------------------------------------------------------

  def send_layer(self, layer_index: int, layer: Any) -> None:
    """Queues one layer cache (jax or numpy arrays, any sharding) for encoding."""
    self._check()
    if not 0 <= layer_index < self.num_layers:
      raise ValueError(f"layer {layer_index} outside the {self.num_layers} layers of "
                       "this transfer")
    self._submit(layer_index)
    self._put_layer((layer_index, layer))

  def send_layers(self, layers: Iterable[tuple[int, Any]]) -> None:
    """Sends every (layer_index, cache) of an iterator as it is produced, e.g.
    ``LayerwisePrefill``; prefill of layer i+1 overlaps sending layer i."""
    for index, layer in layers:
      self.send_layer(index, layer)

  def send_encoded(self, group: EncodedGroup) -> None:
    """Queues an already encoded layer (or the state-level group)."""
    self._check()
    if not GLOBAL_LAYER_INDEX <= group.entry.index < self.num_layers:
      raise ValueError(f"layer {group.entry.index} outside the {self.num_layers} layers of "
                       "this transfer")
    self._submit(group.entry.index)
    self._enqueue_now(group)

  def finish(self, state_arrays: Sequence[tuple[str, Any]] | None = None) -> TransferResult:
    """Sends the state-level arrays, resends what was rejected, commits.

    Args:
      state_arrays: (name, array) outside ``layers``; default
        ``[("lengths", lengths)]`` from ``begin``. Skipped if already sent
        with ``send_encoded``.

    Returns:
      The committed transfer's manifest and timeline.

    Raises:
      TransferError: with the gRPC status of the failure; the transfer is
        aborted on both sides.
    """
    if self._done:
      raise RuntimeError(f"transfer {self.transfer_id} is already committed")
    try:
      if GLOBAL_LAYER_INDEX not in self._submitted:
        if state_arrays is None:
          if self._lengths is None:
            raise ValueError("finish() needs state_arrays when begin() got no lengths")
          state_arrays = [("lengths", np.asarray(self._lengths))]
        self._submit(GLOBAL_LAYER_INDEX)
        try:
          group = encode_state_arrays(list(state_arrays), options=self.codec)
        except Exception as e:
          raise TransferError(Code.INTERNAL, f"encoding state-level arrays failed: {e!r}",
                              self.transfer_id) from e
        self._enqueue_now(group)
      if self._encoder is not None:
        self._put_layer(_FINISH)
        self._encoder.join()
      self._check()
      bundle = None
      if self._stream is None:
        self._frames.close()
      else:
        bundle = self._bundler.take()  # a small state: all of it in one frame
        if bundle is not None:
          self._stream.put(bundle)
          # Written from this thread, as BEGIN: the receiver checks the state
          # while the manifest is built here.
          self._stream.write_through()
      if self._plane_control:
        # The manifest is built while the frames are in flight.
        manifest = self._build_manifest()
        request = self._commit_request(manifest)
        first = self._plane_commit(request, bundle)
        ready = self._commit_with_retries(manifest, request, first)
      else:
        self._wait_streams()
        if self._begin_frame is not None:
          self._begin_reply()
        manifest = self._build_manifest()
        ready = self._commit_with_retries(manifest, self._commit_request(manifest))
      if self._stream is not None:
        self._stream.close()
        self._stream.wait()  # nothing outstanding: gives the connections back
    except TransferError as e:
      self._abort(e)
      raise
    except QueueAborted:
      self._abort(self._error)
      raise self._error
    except Exception as e:
      err = TransferError(Code.INTERNAL, f"sender failed: {e!r}", self.transfer_id)
      self._abort(err)
      raise err from e
    except BaseException:
      self.abort("interrupted")
      raise
    self._done = True
    self._link.end()
    self._recorder.finished("ok", ready)
    return TransferResult(self.transfer_id, manifest, self._recorder.snapshot())

  def abort(self, reason: str = "aborted by caller") -> None:
    """Stops the transfer; the receiver drops everything it received."""
    self._abort(TransferError(Code.CANCELLED, reason, self.transfer_id))

  def timeline(self) -> TransferTimeline:
    """Live snapshot (final once finished or failed)."""
    self._recorder.queue_peak(self._peak_queued())
    return self._recorder.snapshot()

  def __enter__(self) -> "Transfer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is not None and not self._done:
      self._abort(TransferError(Code.CANCELLED, f"sender side raised {exc!r}",
                                self.transfer_id))

  # -- internals -------------------------------------------------------------------

  def _check(self) -> None:
    if self._error is not None:
      raise self._error

  def _submit(self, index: int) -> None:
    if index in self._submitted:
      raise ValueError(f"layer {index} was already sent in this transfer")
    self._submitted.add(index)
    self._recorder.layer_submitted(index)

  def _enqueue_now(self, group: EncodedGroup) -> None:
    """``_enqueue`` in the caller's thread (the encoder may run beside it)."""
    try:
      with self._enqueue_lock:
        self._enqueue(group)
    except QueueAborted:
      self._check()
      raise TransferError(Code.CANCELLED, "transfer aborted", self.transfer_id) from None
    except TransferError as e:
      self._abort(e)
      raise

  def _put_layer(self, item) -> None:
    if self._encoder is None and item is not _FINISH:
      self._encoder = threading.Thread(target=self._encode_loop, daemon=True,
                                       name=f"state-tx-encode-{self.transfer_id[:8]}")
      self._encoder.start()
    # Polls so that a producer blocked on a full layer queue still sees an
    # abort (the encoder stops consuming when the transfer fails).
    while True:
      self._check()
      try:
        self._layers_in.put(item, timeout=0.05)
        return
      except queue.Full:
        pass

  @property
  def open(self) -> bool:
    """Neither finished nor failed: ``abort`` would still end it."""
    return not self._done and self._error is None

  def _set_error(self, err: TransferError) -> bool:
    with self._lock:
      if self._error is not None or self._done:
        return False
      self._error = err
    return True

  def _abort(self, err: TransferError | None) -> None:
    err = err or TransferError(Code.CANCELLED, "aborted", self.transfer_id)
    first = self._set_error(err)
    if first:
      self._abort_thread = threading.current_thread()
    self._frames.abort()
    if self._stream is not None:
      self._stream.abort(err)
    if not self._done:
      self._link.end()  # its unsent bytes will never cross the link
    for call in list(self._calls):
      call.cancel()
    # Unblocks the encoder if it waits for input.
    try:
      self._layers_in.put_nowait(_FINISH)
    except queue.Full:
      pass
    if first:
      self._recorder.finished(err.code.name)
      try:
        self._sender.stub(0).Abort(
            transport_pb2.AbortRequest(transfer_id=self.transfer_id, reason=err.message),
            timeout=self._options.rpc_timeout_s)
      except (grpc.RpcError, ValueError):
        # Unreachable receiver or closed channel: the receiver also fails the
        # transfer on its own, from the broken streams or its deadlines.
        pass
      finally:
        self._abort_sent.set()
    elif not self._done and threading.current_thread() is not self._abort_thread:
      # The failure was first seen on a stream or lane thread, whose Abort RPC
      # may still be in flight: the caller (who may close the sender next)
      # returns only once it went out.
      self._abort_sent.wait(self._options.rpc_timeout_s)

  def _remaining(self) -> float:
    left = self._deadline - time.monotonic()
    if left <= 0:
      raise TransferError(Code.DEADLINE_EXCEEDED, "transfer deadline passed",
                          self.transfer_id)
    return left

  def _encode_loop(self) -> None:
    while True:
      item = self._layers_in.get()
      if item is _FINISH or self._error is not None:
        return
      index, layer = item
      try:
        group = encode_layer(index, layer, token_count=self.token_count, options=self.codec)
        with self._enqueue_lock:
          self._enqueue(group)
      except QueueAborted:
        return
      except TransferError as e:
        self._abort(e)
        return
      except Exception as e:
        self._abort(TransferError(Code.INTERNAL, f"encoding layer {index} failed: {e!r}",
                                  self.transfer_id))
        return

  def _enqueue(self, group: EncodedGroup) -> None:
    entry = group.entry
    if entry.index in self._entries:
      raise TransferError(Code.INVALID_ARGUMENT, f"layer {entry.index} sent twice",
                          self.transfer_id)
    limit = self._max_frame_bytes - channels.FRAME_OVERHEAD_BYTES
    for array, chunk in entry.chunks():
      if chunk.nbytes > limit:
        raise TransferError(Code.INVALID_ARGUMENT,
                            f"layer {entry.index} chunk {chunk.key!r} is {chunk.nbytes} "
                            f"bytes; the receiver takes at most {limit} per frame (lower "
                            "CodecOptions.chunk_bytes)", self.transfer_id)
      self._chunks[chunk.key] = (entry.index, chunk, group.blobs[chunk.key])
    self._entries[entry.index] = entry
    self._recorder.layer_encoded(entry.index, entry.nbytes, entry.num_chunks)
    # The whole layer is pending from here, also the part still waiting for
    # room in the flow-control queue: it is committed to the link.
    self._link.queued_bytes(entry.nbytes, layer_done=entry.index >= 0)
    # Kept for the manifest, which splices the same texts in at Commit.
    layer_json = entry.to_json()
    self._entry_json[entry.index] = (entry, layer_json)
    if self._stream is not None:
      items = self._bundler.hold(group, layer_json)
      if items is not None:  # else held for the BUNDLE that finish sends
        self._stream.put_many(items)
      return
    descriptor = transport_pb2.Frame(layer=transport_pb2.LayerDescriptor(
        transfer_id=self.transfer_id, layer_index=entry.index, layer_json=layer_json))
    self._frames.put((descriptor, entry.index, 0, False), 0)
    for array, chunk in entry.chunks():
      self._frames.put((self._chunk_frame(chunk.key, 0), entry.index, chunk.nbytes, True),
                       chunk.nbytes)

  def _peak_queued(self) -> int:
    return self._stream.peak_bytes if self._stream is not None else self._frames.peak_bytes

  # -- data plane --------------------------------------------------------------------

  def _wait_streams(self) -> None:
    if self._stream is not None:
      try:
        self._stream.drain()  # keeps the connections for Commit and resends
      finally:
        self._recorder.queue_peak(self._stream.peak_bytes)
      self._check()
      return
    for call in self._calls:
      try:
        summary = call.result()
      except grpc.FutureCancelledError:
        self._check()
        raise TransferError(Code.CANCELLED, "Push stream cancelled", self.transfer_id)
      except grpc.RpcError as e:
        raise TransferError.from_rpc_error(e, self.transfer_id, "Push stream failed")
      for r in summary.rejected:
        self._rejected[r.key] = r.reason
    self._recorder.queue_peak(self._frames.peak_bytes)

  def _resend(self, keys: dict[str, str], attempt: int) -> None:
    unknown = [k for k in keys if k not in self._chunks]
    if unknown:
      raise TransferError(Code.INVALID_ARGUMENT, f"receiver asks for unknown chunks "
                          f"{unknown[:3]}", self.transfer_id)
    if self._stream is not None:
      for key in sorted(keys):
        layer, chunk, data = self._chunks[key]
        self._link.queued_bytes(chunk.nbytes)
        self._stream.put(Outgoing(plane_frames.CHUNK, layer, key, chunk.crc32c, data,
                                  is_chunk=True, attempt=attempt, resend=True))
      self._rejected = {}
      self._wait_streams()
      return
    frames = ByteBoundedQueue(self._options.max_inflight_bytes)
    self._frames = frames
    self._open_streams(frames, resend=True, count=min(len(keys), self._options.num_streams))
    for key in sorted(keys):
      layer, chunk, _ = self._chunks[key]
      self._link.queued_bytes(chunk.nbytes)
      frames.put((self._chunk_frame(key, attempt), layer, chunk.nbytes, True), chunk.nbytes)
    frames.close()
    self._rejected = {}
    self._wait_streams()

  def _build_manifest(self) -> StateManifest:
    missing = set(self._entries) ^ set(range(-1, self.num_layers))
    if missing:
      raise TransferError(Code.INVALID_ARGUMENT, f"layers {sorted(missing)} were never sent",
                          self.transfer_id)
    return build_manifest(list(self._entries.values()), model_id=self.model_id,
                          config_fingerprint=self.config_fingerprint,
                          token_count=self.token_count, batch=self._batch, options=self.codec)

  def _commit_request(self, manifest: StateManifest) -> transport_pb2.CommitRequest:
    return transport_pb2.CommitRequest(transfer_id=self.transfer_id,
                                       manifest_json=manifest.to_json(self._entry_json))

  def _commit_with_retries(self, manifest: StateManifest,
                           request: transport_pb2.CommitRequest,
                           response: transport_pb2.CommitResponse | None = None) -> float:
    """``response``: the answer to a COMMIT already sent (the armed one)."""
    pending = {} if response is not None else dict(self._rejected)
    rounds = 0
    while True:
      while pending:
        if rounds >= self._options.max_retry_rounds:
          key, reason = sorted(pending.items())[0]
          layer = self._chunks[key][0] if key in self._chunks else "?"
          raise TransferError(
              Code.DATA_LOSS, f"{len(pending)} chunk(s) still not delivered after "
              f"{rounds} resend round(s), e.g. layer {layer} chunk {key!r}: {reason}",
              self.transfer_id)
        rounds += 1
        self._resend(pending, rounds)
        pending = dict(self._rejected)
      if response is None:
        response = self._commit_once(request)
      if response.complete:
        return response.receiver_ready_s
      pending = {m.key: m.reason for m in response.missing}
      response = None
      if not pending:
        raise TransferError(Code.INTERNAL, "receiver reports an incomplete state but lists "
                            "no missing chunk", self.transfer_id)

  def _commit_once(self, request: transport_pb2.CommitRequest) -> transport_pb2.CommitResponse:
    timeout = min(self._options.commit_timeout_s, self._remaining())
    if self._plane_control:
      body = self._stream.call(plane_frames.COMMIT, request.SerializeToString(),
                               timeout_s=timeout)
      return transport_pb2.CommitResponse.FromString(body)
    try:
      return self._sender.stub(0).Commit(request, timeout=timeout)
    except grpc.RpcError as e:
      raise TransferError.from_rpc_error(e, self.transfer_id, "Commit failed")
