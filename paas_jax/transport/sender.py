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

Split: ``sender_options`` (SenderOptions, TransferResult), ``transfer``
(Transfer), ``push_streams`` (its gRPC Push path) and this module
(StateSender: Begin, connections, data planes); all re-exported here.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from typing import Any, Sequence

import grpc
import numpy as np

from paas_jax.codec import layout
from paas_jax.codec.encode import batch_of, token_count_of
from paas_jax.codec.options import CodecOptions
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport import channels
from paas_jax.transport.counters import LinkCounters
from paas_jax.transport.dataplane.lanes import LanePool
from paas_jax.transport.errors import TransferError
from paas_jax.transport.sender_options import PLANES, SenderOptions, TransferResult
from paas_jax.transport.timeline import TimelineRecorder
from paas_jax.transport.transfer import Transfer

Code = grpc.StatusCode
log = logging.getLogger(__name__)


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
    # BeginRequest.sender_id: the receiver's idle timeout runs per sender.
    self.sender_id = uuid.uuid4().hex
    self._data_host = None if target is None else target.rsplit(":", 1)[0].strip("[]")
    self._pools: dict[int, LanePool] = {}
    self._pools_lock = threading.Lock()
    # The receiver's data port when it announced data_plane_control (Begin
    # and Commit may then ride warm data connections); None: gRPC Begin.
    self._control_port: int | None = None
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

  def stub(self, i: int) -> transport_pb2_grpc.StateTransferStub:
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
        token_count=token_count, sender_id=self.sender_id)
    warm = self._warm_control_pool()
    if warm is not None:
      # The frame limit the receiver announced at the last Begin (its options
      # do not change while it runs); this Begin's answer comes before Commit.
      max_frame = min(warm.announced_max_frame_bytes or self.options.max_message_bytes,
                      self.options.max_message_bytes)
      return self._begin_transfer(
          transfer_id, recorder, warm, begin_request=request,
          max_frame=max_frame, token_count=token_count,
          num_layers=num_layers, model_id=model_id, config_fingerprint=config_fingerprint,
          codec=codec, lengths=lengths, batch=batch)
    try:
      response = self.stub(0).Begin(request, timeout=self.options.rpc_timeout_s)
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
      if pool is not None:
        pool.announced_max_frame_bytes = int(response.max_frame_bytes)
      if pool is not None and response.data_plane_control and self.options.plane_control:
        self._control_port = int(response.data_plane_port)
    return self._begin_transfer(
        transfer_id, recorder, pool, begin_request=None, max_frame=max_frame,
        token_count=token_count, num_layers=num_layers, model_id=model_id,
        config_fingerprint=config_fingerprint, codec=codec, lengths=lengths, batch=batch)

  def _warm_control_pool(self) -> LanePool | None:
    """The data plane to send this transfer's Begin over: the receiver
    announced data_plane_control and an idle connection to it is alive (so
    it was reachable just now; else gRPC Begin, which also re-reads the port)."""
    if self.options.plane != "tcp" or not self.options.plane_control:
      return None
    with self._pools_lock:
      pool = self._pools.get(self._control_port) if self._control_port else None
    return pool if pool is not None and pool.warm() else None

  def _begin_transfer(self, transfer_id: str, recorder: TimelineRecorder,
                      pool: LanePool | None, *, begin_request, max_frame: int, token_count: int,
                      num_layers: int, model_id: str, config_fingerprint: str,
                      codec: CodecOptions, lengths, batch: int) -> "Transfer":
    try:
      transfer = Transfer(self, transfer_id, token_count=token_count, num_layers=num_layers,
                          model_id=model_id, config_fingerprint=config_fingerprint,
                          codec=codec, max_frame_bytes=max_frame,
                          lengths=None if lengths is None else np.asarray(lengths, np.int32),
                          batch=batch, recorder=recorder, pool=pool,
                          begin_request=begin_request)
    except TransferError as e:
      # The data plane could not be reached, or Begin over it failed: the
      # receiver must not keep a begun transfer until its deadline.
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
      self.stub(0).Abort(transport_pb2.AbortRequest(transfer_id=transfer_id, reason=reason),
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
      if transfer.open:
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


__all__ = ["PLANES", "SenderOptions", "StateSender", "Transfer", "TransferResult"]
