"""Prefill-side client: streams a decode state to a decode process, layer by layer.

Three kinds of threads meet in a ``Transfer``:

* the caller (the prefill loop) hands over each layer cache as soon as it is
  produced and goes straight on to the next layer (``send_layer`` never waits
  for the network, only for the flow-control bound on pending layers);
* one encoder thread turns layers into zarr3 objects (``paas_jax.codec``) and
  puts frames into a queue bounded by bytes (flow control: encoding stalls
  when the link is slower than prefill, instead of filling host memory);
* N gRPC client streams, spread over M TCP connections, drain that queue.

``finish`` sends the state-level arrays, closes the streams, resends any
chunk the receiver rejected, and commits the manifest; chunks the receiver
reports missing at Commit are resent and Commit repeated, a bounded number of
rounds. Every RPC carries a deadline. Any failure aborts the transfer on both
sides and raises ``TransferError`` with the gRPC status that explains it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import ssl
import threading
import time
import uuid
import weakref
from typing import Any, Iterable, Sequence

import grpc
import numpy as np

from paas_jax.codec import layout
from paas_jax.codec.encode import (EncodedGroup, batch_of, build_manifest, encode_layer,
                                   encode_state_arrays, token_count_of)
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, ChunkEntry, LayerEntry, StateManifest
from paas_jax.codec.options import CodecOptions
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport import channels
from paas_jax.transport.counters import LinkCounters
from paas_jax.transport.dataplane import frames as plane_frames
from paas_jax.transport.dataplane.lanes import LanePool
from paas_jax.transport.dataplane.streams import LaneStream, Outgoing
from paas_jax.transport.dataplane.tuning import Tuning
from paas_jax.transport.errors import TransferError
from paas_jax.transport.flow import ByteBoundedQueue, QueueAborted
from paas_jax.transport.timeline import TimelineRecorder, TransferTimeline

Code = grpc.StatusCode
log = logging.getLogger(__name__)
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
      long-lived TCP connections per receiver, zero-copy frames). Control
      (Begin, Commit, Abort) stays on gRPC either way. A receiver that
      announces no data-plane port gets the gRPC path.
    lanes: data-plane connections a transfer stripes over.
    window_bytes: unacknowledged bytes per data-plane connection.
    data_ssl: client ``ssl.SSLContext`` of the data plane
      (``dataplane.tls.client_context``); required with ``credentials``.
    tuning: data-plane socket settings (buffers from the bandwidth-delay
      product, congestion control, stall timeout).
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

  def __post_init__(self):
    if self.plane not in PLANES:
      raise ValueError(f"SenderOptions.plane must be one of {PLANES}, not {self.plane!r}")
    if self.lanes < 1 or self.window_bytes < 1:
      raise ValueError("SenderOptions: lanes and window_bytes must be >= 1")
    if self.plane == "tcp" and self.credentials is not None and self.data_ssl is None:
      raise ValueError("SenderOptions: TLS on gRPC needs data_ssl for the tcp data plane "
                       "(plaintext data planes exist only for --insecure deployments)")
    if self.num_streams < 1 or self.num_connections < 1:
      raise ValueError("SenderOptions: num_streams and num_connections must be >= 1")
    if self.max_inflight_bytes < 1:
      raise ValueError("SenderOptions.max_inflight_bytes must be >= 1")


@dataclasses.dataclass(frozen=True)
class TransferResult:
  """A committed transfer: the receiver holds the complete, verified state."""

  transfer_id: str
  manifest: StateManifest
  timeline: TransferTimeline


_FINISH = object()


class Transfer:
  """One state on its way to a decode process. Create with ``StateSender.begin``.

  Use as a context manager: leaving the block with an exception (e.g. the
  prefill failed) aborts the transfer on both sides.
  """

  def __init__(self, sender: "StateSender", transfer_id: str, *, token_count: int,
               num_layers: int, model_id: str, config_fingerprint: str, codec: CodecOptions,
               max_frame_bytes: int, lengths: Any | None, batch: int,
               recorder: TimelineRecorder, pool: LanePool | None = None):
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
    if pool is not None:
      try:
        self._stream = self._open_lane_stream()
      except TransferError:
        self._link.end()
        raise
    else:
      self._open_streams(self._frames, resend=False)
    self._encoder = threading.Thread(target=self._encode_loop, daemon=True,
                                     name=f"state-tx-encode-{transfer_id[:8]}")
    self._encoder.start()

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
    self._put_layer(group)

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
        self._put_layer(("state", list(state_arrays)))
      self._put_layer(_FINISH)
      self._encoder.join()
      self._check()
      if self._stream is not None:
        self._stream.close()
      else:
        self._frames.close()
      self._wait_streams()
      missing = set(self._entries) ^ set(range(-1, self.num_layers))
      if missing:
        raise TransferError(Code.INVALID_ARGUMENT,
                            f"layers {sorted(missing)} were never sent",
                            self.transfer_id)
      manifest = build_manifest(list(self._entries.values()), model_id=self.model_id,
                                config_fingerprint=self.config_fingerprint,
                                token_count=self.token_count,
                                batch=self._batch,
                                options=self.codec)
      ready = self._commit_with_retries(manifest)
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

  def _put_layer(self, item) -> None:
    # Polls so that a producer blocked on a full layer queue still sees an
    # abort (the encoder stops consuming when the transfer fails).
    while True:
      self._check()
      try:
        self._layers_in.put(item, timeout=0.05)
        return
      except queue.Full:
        pass

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
        self._sender._stub(0).Abort(
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
      try:
        if isinstance(item, EncodedGroup):
          group = item
        elif item[0] == "state":
          group = encode_state_arrays(item[1], options=self.codec)
        else:
          index, layer = item
          group = encode_layer(index, layer, token_count=self.token_count, options=self.codec)
        self._enqueue(group)
      except QueueAborted:
        return
      except TransferError as e:
        self._abort(e)
        return
      except Exception as e:
        where = "state-level arrays" if isinstance(item, tuple) and item[0] == "state" else (
            f"layer {item.entry.index if isinstance(item, EncodedGroup) else item[0]}")
        self._abort(TransferError(Code.INTERNAL, f"encoding {where} failed: {e!r}",
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
    self._entries[entry.index] = entry
    for array, chunk in entry.chunks():
      self._chunks[chunk.key] = (entry.index, chunk, group.blobs[chunk.key])
    self._recorder.layer_encoded(entry.index, entry.nbytes, sum(1 for _ in entry.chunks()))
    # The whole layer is pending from here, also the part still waiting for
    # room in the flow-control queue: it is committed to the link.
    self._link.queued_bytes(sum(chunk.nbytes for _, chunk in entry.chunks()),
                            layer_done=entry.index >= 0)
    if self._stream is not None:
      self._stream.put(Outgoing(plane_frames.DESCRIPTOR, entry.index, "", 0,
                                entry.to_json().encode(), is_chunk=False))
      for array, chunk in entry.chunks():
        self._stream.put(Outgoing(plane_frames.CHUNK, entry.index, chunk.key, chunk.crc32c,
                                  group.blobs[chunk.key], is_chunk=True))
      return
    descriptor = transport_pb2.Frame(layer=transport_pb2.LayerDescriptor(
        transfer_id=self.transfer_id, layer_index=entry.index, layer_json=entry.to_json()))
    self._frames.put((descriptor, entry.index, 0, False), 0)
    for array, chunk in entry.chunks():
      self._frames.put((self._chunk_frame(chunk.key, 0), entry.index, chunk.nbytes, True),
                       chunk.nbytes)

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
      call = self._sender._stub(i).Push.future(self._frame_iter(frames, resend),
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

  def _peak_queued(self) -> int:
    return self._stream.peak_bytes if self._stream is not None else self._frames.peak_bytes

  # -- data plane --------------------------------------------------------------------

  def _open_lane_stream(self) -> LaneStream:
    return LaneStream(self._pool, self.transfer_id, lanes=self._options.lanes,
                      max_queued_bytes=self._options.max_inflight_bytes,
                      deadline=self._deadline, on_sent=self._plane_sent,
                      on_error=self._plane_error)

  def _plane_sent(self, item: Outgoing) -> None:
    nbytes = item.nbytes if item.is_chunk else 0
    self._recorder.frame_sent(item.layer, nbytes, item.is_chunk, item.resend)
    if nbytes:
      self._link.sent_bytes(nbytes)

  def _plane_error(self, err: TransferError) -> None:
    if self._error is None and not self._done:
      # Not inline: this runs on a lane thread, which must not block on the Abort RPC.
      threading.Thread(target=self._abort, args=(err,), daemon=True).start()

  def _wait_streams(self) -> None:
    if self._stream is not None:
      try:
        self._stream.wait()
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
      self._stream = self._open_lane_stream()
      for key in sorted(keys):
        layer, chunk, data = self._chunks[key]
        self._link.queued_bytes(chunk.nbytes)
        self._stream.put(Outgoing(plane_frames.CHUNK, layer, key, chunk.crc32c, data,
                                  is_chunk=True, attempt=attempt, resend=True))
      self._stream.close()
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

  def _commit_with_retries(self, manifest: StateManifest) -> float:
    request = transport_pb2.CommitRequest(transfer_id=self.transfer_id,
                                          manifest_json=manifest.to_json())
    pending = dict(self._rejected)
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
      try:
        response = self._sender._stub(0).Commit(
            request, timeout=min(self._options.commit_timeout_s, self._remaining()))
      except grpc.RpcError as e:
        raise TransferError.from_rpc_error(e, self.transfer_id, "Commit failed")
      if response.complete:
        return response.receiver_ready_s
      pending = {m.key: m.reason for m in response.missing}
      if not pending:
        raise TransferError(Code.INTERNAL, "receiver reports an incomplete state but lists "
                            "no missing chunk", self.transfer_id)


class StateSender:
  """Client of one decode process; reusable for many transfers.

  Args:
    target: "host:port" of the decode process's ``StateReceiver``.
    channels_: pre-built channels (e.g. intercepted or with custom
      credentials) instead of ``target``; streams are spread over them.
    options: parallelism, flow control, deadlines, retries, credentials.
    counters: the link gauges its transfers report into (shared by the
      senders of one link, e.g. all of a server's senders to the other
      region); default a private ``LinkCounters``.
  """

  def __init__(self, target: str | None = None, *,
               channels_: Sequence[grpc.Channel] | None = None,
               options: SenderOptions = SenderOptions(),
               counters: LinkCounters | None = None):
    if target is None and channels_ is None:
      raise ValueError("pass target, channels_, or both (channels_ for gRPC and target's "
                       "host for the data plane)")
    self.options = options
    self._data_host = None if target is None else target.rsplit(":", 1)[0].strip("[]")
    self._pools: dict[int, LanePool] = {}
    self._pools_lock = threading.Lock()
    self.counters = counters if counters is not None else LinkCounters()
    me = weakref.ref(self)  # the shared counters must not keep a closed sender alive
    self.counters.add_retransmit_source(lambda: me().retransmits() if me() is not None else 0)
    self._owns_channels = channels_ is None
    if channels_ is None:
      channels_ = channels.make_channels(target, options.num_connections,
                                         max_message_bytes=options.max_message_bytes,
                                         credentials=options.credentials)
    self._channels = list(channels_)
    self._stubs = [transport_pb2_grpc.StateTransferStub(c) for c in self._channels]
    self._transfers: weakref.WeakSet[Transfer] = weakref.WeakSet()

  def _stub(self, i: int) -> transport_pb2_grpc.StateTransferStub:
    return self._stubs[i % len(self._stubs)]

  def begin(self, *, model_id: str, config_fingerprint: str, num_layers: int,
            lengths: Any | None = None, token_count: int | None = None,
            batch: int | None = None, codec: CodecOptions = CodecOptions(),
            transfer_id: str | None = None, reserve_bytes: int = 0) -> Transfer:
    """Opens a transfer.

    Args:
      model_id, config_fingerprint: checked by the receiver (FAILED_PRECONDITION
        on mismatch).
      num_layers: layers that will be sent.
      lengths: int32 [batch] the state will have after prefill (prompt
        lengths); sent as the state-level ``lengths`` array by ``finish``.
      token_count: live tokens kept per attention cache; default max(lengths).
      batch: requests in the state; default len(lengths).
      codec: per-link codec options.
      reserve_bytes: encoded bytes to reserve at the receiver up front (e.g.
        ``state_bytes(config, n).total``); 0 reserves as chunks arrive.

    Raises:
      TransferError: FAILED_PRECONDITION, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
        UNAVAILABLE...
    """
    if token_count is None:
      if lengths is None:
        raise ValueError("begin() needs lengths or token_count")
      token_count = token_count_of({"lengths": lengths})
    if lengths is not None:
      batch = len(lengths)
    if batch is None:
      raise ValueError("begin() needs lengths or batch")
    transfer_id = transfer_id or uuid.uuid4().hex
    tcp = self.options.plane == "tcp"
    recorder = TimelineRecorder(transfer_id,
                                self.options.lanes if tcp else self.options.num_streams,
                                self.options.lanes if tcp else len(self._channels))
    request = transport_pb2.BeginRequest(
        transfer_id=transfer_id, model_id=model_id, config_fingerprint=config_fingerprint,
        num_layers=num_layers, reserve_bytes=reserve_bytes, codec_json=codec.to_json(),
        token_count=token_count)
    try:
      response = self._stub(0).Begin(request, timeout=self.options.rpc_timeout_s)
    except grpc.RpcError as e:
      code = e.code() if hasattr(e, "code") else None
      recorder.finished(code.name if code else "UNKNOWN")
      if code == Code.DEADLINE_EXCEEDED:
        # The receiver may have begun it after all: do not leave it to its deadline.
        self._abort_begun(transfer_id, "Begin timed out at the sender")
      raise TransferError.from_rpc_error(e, transfer_id, "Begin refused") from None
    max_frame = min(int(response.max_frame_bytes) or self.options.max_message_bytes,
                    self.options.max_message_bytes)
    pool = None
    if self.options.plane == "tcp":
      try:
        pool = self._pool(int(response.data_plane_port))
      except Exception:
        self._abort_begun(transfer_id, "sender could not set up its data plane")
        recorder.finished("INTERNAL")
        raise
    try:
      transfer = Transfer(self, transfer_id, token_count=token_count, num_layers=num_layers,
                          model_id=model_id, config_fingerprint=config_fingerprint,
                          codec=codec, max_frame_bytes=max_frame,
                          lengths=None if lengths is None else np.asarray(lengths, np.int32),
                          batch=batch, recorder=recorder, pool=pool)
    except TransferError as e:
      # The data plane could not be reached: the receiver must not keep the
      # begun transfer until its deadline.
      self._abort_begun(transfer_id, e.message)
      recorder.finished(e.code.name)
      raise
    self._transfers.add(transfer)
    return transfer

  def _pool(self, port: int) -> LanePool | None:
    """The long-lived connections to the receiver's data plane at ``port``."""
    if not port:
      log.info("receiver announces no data plane; this transfer uses gRPC streams")
      return None
    if self._data_host is None:
      raise ValueError("plane='tcp' with channels_ needs target too (its host is where "
                       "the data plane is dialled)")
    with self._pools_lock:
      pool = self._pools.get(port)
      if pool is None:
        o = self.options
        pool = LanePool(self._data_host, port, ssl_context=o.data_ssl,
                        window_bytes=o.window_bytes, tuning=o.tuning)
        self._pools[port] = pool
      return pool

  def _abort_begun(self, transfer_id: str, reason: str) -> None:
    try:
      self._stub(0).Abort(transport_pb2.AbortRequest(transfer_id=transfer_id, reason=reason),
                          timeout=self.options.rpc_timeout_s)
    except (grpc.RpcError, ValueError):
      pass

  def retransmits(self) -> int:
    """TCP retransmissions on this sender's live data-plane connections."""
    return sum(p.retransmits() for p in self.data_planes)

  @property
  def data_planes(self) -> list[LanePool]:
    with self._pools_lock:
      return list(self._pools.values())

  def send_state(self, state: Any, *, model_id: str, config_fingerprint: str,
                 codec: CodecOptions = CodecOptions(), transfer_id: str | None = None,
                 reserve_bytes: int = 0) -> TransferResult:
    """Sends a whole ``DecodeState`` (store-then-send; for pipelining use
    ``begin`` + ``send_layers``)."""
    layers, rest = layout.split_state(state)
    with self.begin(model_id=model_id, config_fingerprint=config_fingerprint,
                    num_layers=len(layers), token_count=token_count_of(state), codec=codec,
                    transfer_id=transfer_id, reserve_bytes=reserve_bytes,
                    batch=batch_of(state)) as tx:
      for i, layer in enumerate(layers):
        tx.send_layer(i, layer)
      return tx.finish(state_arrays=rest)

  def close(self) -> None:
    """Aborts unfinished transfers, then closes the channels it created."""
    for transfer in list(self._transfers):
      if not transfer._done and transfer._error is None:
        transfer.abort("sender closed")
    with self._pools_lock:
      pools, self._pools = list(self._pools.values()), {}
    for pool in pools:
      pool.close()
    if self._owns_channels:
      for c in self._channels:
        c.close()

  def __enter__(self) -> "StateSender":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
