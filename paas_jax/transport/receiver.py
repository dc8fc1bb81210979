"""Decode-side gRPC servicer: assembles, verifies and restores incoming states.

Life of a transfer here: Begin (model and config fingerprint checked, byte
budget reserved) -> Push frames on any number of streams (each chunk checked
against its size and crc32c on arrival, and against its layer descriptor) ->
each layer whose objects are all verified is moved into a private in-memory
TensorStore and, when the decode side gave a template, restored into device
arrays right away, while later layers are still in flight -> Commit (the
manifest must match what arrived; anything missing is listed for resending)
-> the complete state is handed to ``on_ready`` or the ``ready`` queue.

A transfer that fails for any reason (bad data past the retry limit, a
stream that ends without StreamEnd because the sender died, an idle or total
deadline, Abort) is removed at once: its staged bytes, restored layers and
budget reservation are dropped, and nothing of it is ever handed over.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import ssl
import threading
import time
from concurrent import futures
from typing import Any, Callable, Mapping, Sequence

import grpc

from paas_jax.codec import layout
from paas_jax.codec.decode import (RestoreTemplate, ShardingsLike, assemble, check_template,
                                   restore_from_store, restore_indexed_group)
from paas_jax.codec.errors import CodecError
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, LayerEntry, StateManifest
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.store import MemoryStore, crc32c
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport import channels
from paas_jax.transport.dataplane.interface import TransferRefused
from paas_jax.transport.dataplane.server import DataPlaneServer
from paas_jax.transport.dataplane.tuning import Tuning
from paas_jax.transport.timeline import ReceiveTimeline

log = logging.getLogger(__name__)

Code = grpc.StatusCode


@dataclasses.dataclass(frozen=True)
class ReceiverOptions:
  """Limits of the decode side.

  Attributes:
    byte_budget: encoded bytes all in-progress transfers may hold together;
      Begin (or a chunk past the reservation) beyond it gets RESOURCE_EXHAUSTED.
    max_message_bytes: largest gRPC message accepted.
    transfer_timeout_s: a transfer not committed this long after Begin fails
      with DEADLINE_EXCEEDED.
    idle_timeout_s: ... likewise when no frame arrived for this long (a hung
      sender that keeps its connection open).
    max_chunk_attempts: a chunk failing verification this many times fails
      the transfer with DATA_LOSS.
    restore_workers: threads restoring completed layers during the transfer.
    reap_interval_s: how often deadlines are checked.
    failures_kept: recent failed transfer ids remembered for late RPCs.
  """

  byte_budget: int = 4 << 30
  max_message_bytes: int = channels.DEFAULT_MAX_MESSAGE_BYTES
  transfer_timeout_s: float = 600.0
  idle_timeout_s: float = 30.0
  max_chunk_attempts: int = 4
  restore_workers: int = 2
  reap_interval_s: float = 0.1
  failures_kept: int = 1024


@dataclasses.dataclass(frozen=True)
class TransferInfo:
  """What Begin announced."""

  transfer_id: str
  model_id: str
  config_fingerprint: str
  num_layers: int
  token_count: int
  codec: CodecOptions
  peer: str


# (template state, shardings) for a transfer: e.g.
# lambda info: (abstract_state(cfg, 1, round_up(info.token_count + max_new)), None)
TemplateFn = Callable[[TransferInfo], tuple[Any, ShardingsLike]]


@dataclasses.dataclass
class ReceivedState:
  """A complete, verified state handed to the decode side.

  Attributes:
    info: what Begin announced.
    manifest: the committed manifest.
    state: the restored state when the receiver has a template, else None.
    store: the verified encoded objects when it has none (restore with
      ``restore``), else None.
    timeline: the receiving side's timeline.
  """

  info: TransferInfo
  manifest: StateManifest
  state: Any | None
  store: MemoryStore | None
  timeline: ReceiveTimeline

  def restore(self, like: Any, shardings: ShardingsLike = None) -> Any:
    """Restores into ``like`` (and drops the encoded objects)."""
    if self.state is not None:
      return self.state
    if self.store is None:
      raise RuntimeError("state already restored or released")
    try:
      return restore_from_store(self.store, self.manifest, like, shardings)
    finally:
      self.release()

  def release(self) -> None:
    if self.store is not None:
      self.store.close()
      self.store = None


class _Failed(Exception):
  """Fails the whole transfer with this status."""

  def __init__(self, code: grpc.StatusCode, message: str):
    self.code, self.message = code, message
    super().__init__(message)


class _Refused(_Failed):
  """Refuses one RPC but leaves the transfer as it is."""


def _restore_layer(t: "_Inbound", store: MemoryStore, entry: LayerEntry, like: Any,
                   shardings: ShardingsLike) -> dict[str, Any]:
  """``restore_group``, reusing the transfer's indexed template."""
  cached = t.template_index
  if cached is None or cached[0] is not like or cached[1] is not shardings:
    cached = (like, shardings, RestoreTemplate(like, shardings))
    t.template_index = cached
  return restore_indexed_group(store, entry, cached[2])


class _Inbound:
  """One transfer in progress. Guarded by its own lock (chunk handling) and
  by the receiver's lock (registry and budget)."""

  def __init__(self, info: TransferInfo, template, now: float, deadline: float):
    self.info = info
    self.template = template  # (like, shardings) or None
    self.lock = threading.Lock()
    self.begin_s = time.time()  # wall clock, for timelines
    self.deadline = deadline  # monotonic
    self.last_activity = now
    self.status = "open"  # open | committing | done | failed
    self.reserved = 0
    self.held = 0
    self.descriptors: dict[int, LayerEntry] = {}
    self.expected: dict[int, dict[str, int]] = {}  # layer -> key -> crc32c
    self.verified: dict[str, tuple[int, int]] = {}  # key -> (layer, crc32c)
    self.pending: dict[str, bytes] = {}
    self.flushed: set[int] = set()
    self.store: MemoryStore | None = MemoryStore()
    self.restores: dict[int, futures.Future] = {}
    # (like, shardings, RestoreTemplate): the template indexed by leaf name once per
    # transfer rather than once per restored layer.
    self.template_index: tuple | None = None
    self.attempts: collections.Counter = collections.Counter()
    self.first_byte: float | None = None
    self.last_byte: float | None = None
    self.bytes_received = 0
    self.chunks_received = 0
    self.rejected = 0
    self.layers_complete: dict[int, float] = {}

  def timeline(self, status: str, ready: float | None = None) -> ReceiveTimeline:
    return ReceiveTimeline(
        transfer_id=self.info.transfer_id, status=status, begin_s=self.begin_s,
        first_byte_s=self.first_byte, last_byte_s=self.last_byte, ready_s=ready,
        bytes_received=self.bytes_received, chunks_received=self.chunks_received,
        rejected_chunks=self.rejected, layers_complete_s=dict(self.layers_complete))


def _location(layer: int, key: str) -> str:
  where = "state-level arrays" if layer == GLOBAL_LAYER_INDEX else f"layer {layer}"
  return f"{where}, chunk {key!r}"


class StateReceiver(transport_pb2_grpc.StateTransferServicer):
  """gRPC servicer of the decode process.

  Args:
    models: model id -> config fingerprint this decode process serves; Begin
      for anything else is refused with FAILED_PRECONDITION.
    template: optional ``f(TransferInfo) -> (like, shardings)``; with it,
      layers are restored into device arrays while the transfer runs and
      ``ReceivedState.state`` is set; without it, ``ReceivedState.store``
      holds the verified objects.
    on_ready: called with each complete ``ReceivedState`` (in the Commit RPC's
      thread, before the sender is told the state arrived); default: put it
      into ``self.ready``.
    on_failure: called with (transfer_id, grpc.StatusCode, message) once per
      failed transfer.
    options: limits.
  """

  def __init__(self, *, models: Mapping[str, str], template: TemplateFn | None = None,
               on_ready: Callable[[ReceivedState], None] | None = None,
               on_failure: Callable[[str, grpc.StatusCode, str], None] | None = None,
               options: ReceiverOptions = ReceiverOptions()):
    self.models = dict(models)
    self.template = template
    self.options = options
    self.ready: queue.Queue[ReceivedState] = queue.Queue()
    self._on_ready = on_ready or self.ready.put
    self._on_failure = on_failure
    self._lock = threading.Lock()
    self._active: dict[str, _Inbound] = {}
    self._failures: collections.OrderedDict[str, tuple[grpc.StatusCode, str]] = (
        collections.OrderedDict())
    self._timelines: collections.OrderedDict[str, ReceiveTimeline] = collections.OrderedDict()
    self._reserved_total = 0
    self._pool = futures.ThreadPoolExecutor(max_workers=options.restore_workers,
                                            thread_name_prefix="state-restore")
    self._stop = threading.Event()
    self._reaper = threading.Thread(target=self._reap_loop, name="state-rx-reaper",
                                    daemon=True)
    self._reaper.start()
    # Set by serve_receiver when it also starts a TCP data plane.
    self.data_plane_port = 0

  # -- introspection (scheduler, tests) ------------------------------------------

  @property
  def bytes_in_use(self) -> int:
    """Budget reserved by in-progress transfers."""
    with self._lock:
      return self._reserved_total

  def active_transfers(self) -> list[str]:
    with self._lock:
      return list(self._active)

  def failure(self, transfer_id: str) -> tuple[grpc.StatusCode, str] | None:
    with self._lock:
      return self._failures.get(transfer_id)

  def timeline(self, transfer_id: str) -> ReceiveTimeline | None:
    """Receive-side timeline of a finished or running transfer."""
    with self._lock:
      t = self._active.get(transfer_id)
      if t is not None:
        return t.timeline(t.status)
      return self._timelines.get(transfer_id)

  def close(self) -> None:
    """Fails every in-progress transfer and stops the background threads."""
    self._stop.set()
    for tid in self.active_transfers():
      self._fail_id(tid, Code.UNAVAILABLE, "receiver shutting down")
    self._reaper.join(timeout=5)
    self._pool.shutdown(wait=True, cancel_futures=True)

  # -- bookkeeping -----------------------------------------------------------------

  def _remember(self, tid: str, timeline: ReceiveTimeline,
                failure: tuple[grpc.StatusCode, str] | None) -> None:
    # Caller holds self._lock.
    self._timelines[tid] = timeline
    if failure is not None:
      self._failures[tid] = failure
    for d in (self._timelines, self._failures):
      while len(d) > self.options.failures_kept:
        d.popitem(last=False)

  def _release(self, t: _Inbound) -> None:
    # Caller holds self._lock. Drops every byte the transfer staged.
    self._reserved_total -= t.reserved
    t.reserved = 0
    t.held = 0
    t.pending.clear()
    for f in t.restores.values():
      f.cancel()
    t.restores.clear()
    if t.store is not None:
      t.store.close()
      t.store = None
    t.template = None
    t.template_index = None
    self._active.pop(t.info.transfer_id, None)

  def _fail(self, t: _Inbound, code: grpc.StatusCode, message: str) -> bool:
    with self._lock:
      if t.status in ("done", "failed"):
        return False
      t.status = "failed"
      self._release(t)
      self._remember(t.info.transfer_id, t.timeline(code.name), (code, message))
    log.warning("transfer %s failed: %s: %s", t.info.transfer_id, code.name, message)
    if self._on_failure is not None:
      try:
        self._on_failure(t.info.transfer_id, code, message)
      except Exception:  # A broken callback must not wedge the receiver.
        log.exception("on_failure callback raised")
    return True

  def _fail_id(self, tid: str, code: grpc.StatusCode, message: str) -> None:
    with self._lock:
      t = self._active.get(tid)
    if t is not None:
      self._fail(t, code, message)

  def _get(self, tid: str) -> _Inbound:
    with self._lock:
      t = self._active.get(tid)
      if t is not None:
        return t
      failed = self._failures.get(tid)
    if failed is not None:
      raise _Failed(failed[0], f"transfer {tid} already failed: {failed[1]}")
    raise _Failed(Code.NOT_FOUND, f"no transfer {tid!r} in progress (never begun, "
                                  "already committed, or reaped)")

  def _reserve(self, t: _Inbound, nbytes: int) -> None:
    """Grows the transfer's reservation to cover ``nbytes`` more held bytes."""
    with self._lock:
      need = t.held + nbytes - t.reserved
      if need > 0:
        if self._reserved_total + need > self.options.byte_budget:
          raise _Failed(Code.RESOURCE_EXHAUSTED,
                        f"receiver byte budget full: {self._reserved_total} of "
                        f"{self.options.byte_budget} bytes in use, transfer needs {need} more")
        t.reserved += need
        self._reserved_total += need
      t.held += nbytes

  def _reap_loop(self) -> None:
    while not self._stop.wait(self.options.reap_interval_s):
      now = time.monotonic()
      with self._lock:
        candidates = [t for t in self._active.values() if t.status == "open"]
      for t in candidates:
        if now > t.deadline:
          self._fail(t, Code.DEADLINE_EXCEEDED,
                     f"not committed within {self.options.transfer_timeout_s:g} s of Begin")
        elif now - t.last_activity > self.options.idle_timeout_s:
          self._fail(t, Code.DEADLINE_EXCEEDED,
                     f"no frame for {self.options.idle_timeout_s:g} s (sender hung or gone)")

  # -- RPCs --------------------------------------------------------------------------

  def Begin(self, request, context):
    tid = request.transfer_id
    if not tid:
      context.abort(Code.INVALID_ARGUMENT, "Begin: empty transfer_id")
    want = self.models.get(request.model_id)
    if want is None:
      context.abort(Code.FAILED_PRECONDITION,
                    f"this decode process does not serve model {request.model_id!r} "
                    f"(serves {sorted(self.models)})")
    if want != request.config_fingerprint:
      context.abort(Code.FAILED_PRECONDITION,
                    f"config fingerprint mismatch for model {request.model_id!r}: sender has "
                    f"{request.config_fingerprint}, this decode process has {want}")
    try:
      codec = CodecOptions.from_json(request.codec_json) if request.codec_json else CodecOptions()
    except (ValueError, TypeError) as e:
      context.abort(Code.INVALID_ARGUMENT, f"Begin: bad codec_json: {e}")
    info = TransferInfo(transfer_id=tid, model_id=request.model_id,
                        config_fingerprint=request.config_fingerprint,
                        num_layers=int(request.num_layers), token_count=int(request.token_count),
                        codec=codec, peer=context.peer())
    template = None
    if self.template is not None:
      try:
        template = self.template(info)
      except Exception as e:
        context.abort(Code.FAILED_PRECONDITION, f"no decode template for this transfer: {e}")
      like_layers, _ = layout.split_state(template[0])
      if len(like_layers) != info.num_layers:
        context.abort(Code.INVALID_ARGUMENT,
                      f"Begin announces {info.num_layers} layers, the decode model has "
                      f"{len(like_layers)}")
    now = time.monotonic()
    t = _Inbound(info, template, now, now + self.options.transfer_timeout_s)
    with self._lock:
      if tid in self._active or tid in self._failures or tid in self._timelines:
        t.store.close()
        context.abort(Code.ALREADY_EXISTS, f"transfer id {tid!r} was already used")
      reserve = int(request.reserve_bytes)
      if self._reserved_total + reserve > self.options.byte_budget:
        t.store.close()
        context.abort(Code.RESOURCE_EXHAUSTED,
                      f"receiver byte budget full: {self._reserved_total} of "
                      f"{self.options.byte_budget} bytes in use, transfer reserves {reserve}")
      t.reserved = reserve
      self._reserved_total += reserve
      self._active[tid] = t
    return transport_pb2.BeginResponse(max_frame_bytes=self.options.max_message_bytes,
                                       data_plane_port=self.data_plane_port)

  def Push(self, request_iterator, context):
    t: _Inbound | None = None
    chunks = nbytes = frames = 0
    rejected: list[transport_pb2.ChunkStatus] = []
    ended = False
    try:
      for frame in request_iterator:
        body = frame.WhichOneof("body")
        if body == "end":
          if frame.end.frames != frames:
            raise _Failed(Code.DATA_LOSS, f"stream carried {frames} frames, sender says "
                                          f"{frame.end.frames}")
          ended = True
          break
        frames += 1
        msg = frame.chunk if body == "chunk" else frame.layer
        if body not in ("chunk", "layer"):
          raise _Failed(Code.INVALID_ARGUMENT, "empty frame")
        if t is None:
          t = self._get(msg.transfer_id)
        elif msg.transfer_id != t.info.transfer_id:
          raise _Failed(Code.INVALID_ARGUMENT, "one stream carries one transfer; got frames "
                                               f"of {t.info.transfer_id} and {msg.transfer_id}")
        if t.status == "failed":
          raise _Failed(*(self.failure(t.info.transfer_id)
                          or (Code.ABORTED, "transfer failed")))
        t.last_activity = time.monotonic()
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
    except _Failed as e:
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

  def _on_descriptor(self, t: _Inbound, msg) -> None:
    try:
      entry = LayerEntry.from_json(msg.layer_json)
    except (ValueError, KeyError, TypeError) as e:
      raise _Failed(Code.INVALID_ARGUMENT, f"layer {msg.layer_index}: bad descriptor: {e}")
    self._adopt_descriptor(t, entry, msg.layer_index)

  def _adopt_descriptor(self, t: _Inbound, entry: LayerEntry, layer_index: int) -> None:
    if entry.index != layer_index:
      raise _Failed(Code.INVALID_ARGUMENT,
                    f"descriptor of layer {entry.index} sent as layer {layer_index}")
    if not GLOBAL_LAYER_INDEX <= entry.index < t.info.num_layers:
      raise _Failed(Code.INVALID_ARGUMENT, f"layer {entry.index} outside the "
                                           f"{t.info.num_layers} layers announced by Begin")
    if t.template is not None and entry.index != GLOBAL_LAYER_INDEX:
      like_layers, _ = layout.split_state(t.template[0])
      want = layout.layer_kind(like_layers[entry.index])
      if want != entry.kind:
        raise _Failed(Code.INVALID_ARGUMENT, f"layer {entry.index} is {entry.kind} at the "
                                             f"sender but {want} in the decode model")
    with t.lock:
      old = t.descriptors.get(entry.index)
      if old == entry:
        return
      if old is not None and entry.index in t.flushed:
        raise _Failed(Code.INVALID_ARGUMENT,
                      f"layer {entry.index} changed after all its chunks had arrived")
      t.descriptors[entry.index] = entry
      expected = {c.key: c.crc32c for _, c in entry.chunks()}
      t.expected[entry.index] = expected
      # Objects that arrived before the descriptor and disagree with it are
      # dropped; they will be listed as missing at Commit.
      dropped = 0
      for key, (layer, crc) in list(t.verified.items()):
        if layer == entry.index and expected.get(key) != crc:
          del t.verified[key]
          dropped += len(t.pending.pop(key, b""))
      if dropped:
        with self._lock:
          t.held -= dropped
    self._maybe_complete(t, entry.index)

  def _on_chunk(self, t: _Inbound, c) -> tuple[str | None, int]:
    """Stores a chunk if it verifies; returns (why it was rejected or None, bytes)."""
    # Every access to a protobuf bytes field copies it: read it once.
    return self._accept_chunk(t, c.layer_index, c.key, c.crc32c, c.nbytes, c.data)

  def _accept_chunk(self, t: _Inbound, layer: int, key: str, crc: int, nbytes: int,
                    data) -> tuple[str | None, int]:
    """Verifies one object (gRPC frame or data-plane buffer) and keeps ``data``."""
    reason = None
    if not GLOBAL_LAYER_INDEX <= layer < t.info.num_layers:
      reason = f"layer {layer} outside the {t.info.num_layers} layers announced by Begin"
    elif layer >= 0 and not key.startswith(layout.layer_prefix(layer) + "/"):
      reason = f"key is not under {layout.layer_prefix(layer)}/"
    elif layer < 0 and key.startswith("layers/"):
      reason = "state-level chunk with a layer key"
    elif len(data) != nbytes:
      reason = (f"truncated: {len(data)} of {nbytes} bytes" if len(data) < nbytes
                else f"size mismatch: {len(data)} bytes, frame says {nbytes}")
    else:
      got = crc32c(data)
      if got != crc:
        reason = f"crc32c mismatch: data has 0x{got:08x}, frame says 0x{crc:08x}"
    with t.lock:
      if reason is None:
        expected = t.expected.get(layer)
        if expected is not None:
          want = expected.get(key)
          if want is None:
            reason = "not listed in the layer descriptor"
          elif want != crc:
            reason = f"crc32c 0x{crc:08x} differs from the layer descriptor's 0x{want:08x}"
      if reason is not None:
        t.attempts[key] += 1
        t.rejected += 1
        if t.attempts[key] >= self.options.max_chunk_attempts:
          raise _Failed(Code.DATA_LOSS, f"{_location(layer, key)} failed verification "
                                        f"{t.attempts[key]} times; last: {reason}")
        return reason, len(data)
      if key in t.verified:
        return None, 0  # A resend of something that already arrived intact.
      if t.status == "failed":
        raise _Failed(*(self.failure(t.info.transfer_id) or (Code.ABORTED, "transfer failed")))
      self._reserve(t, len(data))
      now = time.time()
      t.verified[key] = (layer, crc)
      t.pending[key] = data
      t.first_byte = t.first_byte or now
      t.last_byte = now
      t.bytes_received += len(data)
      t.chunks_received += 1
    self._maybe_complete(t, layer)
    return None, len(data)

  # -- data plane (paas_jax.transport.dataplane.interface.FrameSink) ------------------

  @property
  def max_frame_bytes(self) -> int:
    return self.options.max_message_bytes

  def plane_lookup(self, transfer_id: str) -> _Inbound:
    try:
      t = self._get(transfer_id)
    except _Failed as e:
      raise TransferRefused(e.code, e.message) from None
    if t.status == "failed":
      code, message = self.failure(transfer_id) or (Code.ABORTED, "transfer failed")
      raise TransferRefused(code, message)
    return t

  def plane_descriptor(self, t: _Inbound, layer: int, layer_json: str) -> None:
    t.last_activity = time.monotonic()
    try:
      try:
        entry = LayerEntry.from_json(layer_json)
      except (ValueError, KeyError, TypeError) as e:
        raise _Failed(Code.INVALID_ARGUMENT, f"layer {layer}: bad descriptor: {e}")
      self._adopt_descriptor(t, entry, layer)
    except _Failed as e:
      self._fail(t, e.code, e.message)
      raise TransferRefused(e.code, e.message) from None

  def plane_chunk(self, t: _Inbound, layer: int, key: str, crc: int, data) -> str | None:
    t.last_activity = time.monotonic()
    try:
      reason, _ = self._accept_chunk(t, layer, key, crc, len(data), data)
    except _Failed as e:
      self._fail(t, e.code, e.message)
      raise TransferRefused(e.code, e.message) from None
    return None if reason is None else f"{_location(layer, key)}: {reason}"

  def _maybe_complete(self, t: _Inbound, layer: int) -> None:
    """Moves a fully verified layer into the store and starts restoring it."""
    with t.lock:
      entry = t.descriptors.get(layer)
      if entry is None or layer in t.flushed or t.store is None:
        return
      keys = t.expected[layer]
      if not all(k in t.verified for k in keys):
        return
      blobs = {k: t.pending.pop(k) for k in keys if k in t.pending}
      t.store.put_many(blobs)
      t.flushed.add(layer)
      t.layers_complete[layer] = time.time()
      if t.template is not None and t.status != "failed":
        like, shardings = t.template
        t.restores[layer] = self._pool.submit(_restore_layer, t, t.store, entry, like,
                                              shardings)

  def Commit(self, request, context):
    t = None
    try:
      t = self._get(request.transfer_id)
      try:
        manifest = StateManifest.from_json(request.manifest_json)
      except (ValueError, KeyError, TypeError) as e:
        raise _Failed(Code.INVALID_ARGUMENT, f"Commit: bad manifest: {e}")
      info = t.info
      if (manifest.model_id, manifest.config_fingerprint) != (info.model_id,
                                                              info.config_fingerprint):
        raise _Failed(Code.FAILED_PRECONDITION,
                      f"manifest is for {manifest.model_id!r}/{manifest.config_fingerprint}, "
                      f"Begin announced {info.model_id!r}/{info.config_fingerprint}")
      if len(manifest.layers) != info.num_layers:
        raise _Failed(Code.INVALID_ARGUMENT, f"manifest has {len(manifest.layers)} layers, "
                                             f"Begin announced {info.num_layers}")
      for group in manifest.groups:
        self._adopt_descriptor(t, group, group.index)
      with t.lock:
        missing = [transport_pb2.ChunkStatus(layer_index=g.index, key=c.key,
                                             reason="not received intact")
                   for g in manifest.groups for _, c in g.chunks() if c.key not in t.verified]
        if missing:
          return transport_pb2.CommitResponse(complete=False, missing=missing)
        if t.status != "open":
          raise _Refused(Code.FAILED_PRECONDITION, f"transfer is already {t.status}")
        t.status = "committing"
      state, store = self._finish_restore(t, manifest)
    except _Failed as e:
      if t is not None and not isinstance(e, _Refused):
        self._fail(t, e.code, e.message)
      context.abort(e.code, e.message)
    ready = time.time()
    with self._lock:
      timeline = t.timeline("ok", ready)
      if store is not None:
        t.store = None  # Handed over with the state; the decode side owns it now.
      t.status = "done"
      self._release(t)
      self._remember(info.transfer_id, timeline, None)
    received = ReceivedState(info=info, manifest=manifest, state=state, store=store,
                             timeline=timeline)
    try:
      self._on_ready(received)
    except Exception as e:
      log.exception("on_ready callback raised")
      received.release()
      context.abort(Code.INTERNAL, f"decode side rejected the state: {e}")
    return transport_pb2.CommitResponse(complete=True, receiver_ready_s=ready - t.begin_s)

  def _finish_restore(self, t: _Inbound, manifest: StateManifest):
    for group in manifest.groups:
      self._maybe_complete(t, group.index)
    if t.template is None:
      return None, t.store
    like, shardings = t.template
    try:
      check_template(manifest, like)
      restored = {}
      for group in manifest.groups:
        restored.update(t.restores[group.index].result())
      return assemble(like, restored), None
    except (CodecError, KeyError, ValueError) as e:
      raise _Failed(Code.INVALID_ARGUMENT, f"state does not fit the decode model: {e}")
    except Exception as e:
      raise _Failed(Code.DATA_LOSS, f"restoring the verified state failed: {e!r}")

  def Abort(self, request, context):
    with self._lock:
      t = self._active.get(request.transfer_id)
    existed = t is not None and self._fail(
        t, Code.CANCELLED, f"aborted by sender: {request.reason or 'no reason given'}")
    return transport_pb2.AbortResponse(existed=existed)


@dataclasses.dataclass
class ReceiverServer:
  """A running gRPC server hosting a ``StateReceiver`` (and its data plane, if any)."""

  server: grpc.Server
  receiver: StateReceiver
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


def serve_receiver(receiver: StateReceiver, address: str = "127.0.0.1:0", *,
                   credentials: grpc.ServerCredentials | None = None,
                   max_workers: int = 32,
                   maximum_concurrent_rpcs: int | None = None,
                   interceptors=(), data_plane: bool = False,
                   data_ssl: ssl.SSLContext | None = None,
                   data_peers: Sequence[str] | None = None,
                   data_tuning: Tuning | None = None,
                   data_host: str | None = None) -> ReceiverServer:
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
  announced port number at the host senders dial).
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
    plane = DataPlaneServer(receiver, data_host or host.strip("[]") or "0.0.0.0", 0,
                            ssl_context=data_ssl,
                            peer_patterns=data_peers, tuning=data_tuning or Tuning())
    receiver.data_plane_port = plane.port
  server.start()
  return ReceiverServer(server=server, receiver=receiver, port=port, address=f"{host}:{port}",
                        data_plane=plane)
