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

Split: ``inbound`` (options, per-transfer state, ReceivedState), ``ingress``
(gRPC Push and the data plane's frames into this receiver), this module
(Begin, verification, Commit, failure and budgets) and ``receiver_server``
(``serve_receiver``, which imports this one). ``paas_jax.transport`` exports
the public names of all four.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from concurrent import futures
from typing import Callable, Mapping

import grpc

from paas_jax.codec import layout
from paas_jax.codec.decode import assemble, check_template
from paas_jax.codec.errors import CodecError
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, LayerEntry, StateManifest
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.store import crc32c
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport.inbound import (Inbound, ReceivedState, ReceiverOptions, RpcRefused,
                                        SenderClock, TemplateFn, TransferFailed, TransferInfo,
                                        check_descriptor, location, manifest_from_descriptors,
                                        restore_layer)
from paas_jax.transport.ingress import FrameIngress
from paas_jax.transport.timeline import ReceiveTimeline

log = logging.getLogger(__name__)

Code = grpc.StatusCode


class StateReceiver(FrameIngress, transport_pb2_grpc.StateTransferServicer):
  """gRPC servicer of the decode process.

  Args:
    models: model id -> config fingerprint this decode process serves; Begin
      for anything else is refused with FAILED_PRECONDITION.
    template: optional ``f(TransferInfo) -> (like, shardings)``; with it,
      layers are restored into device arrays while the transfer runs and
      ``ReceivedState.state`` is set; without it (or when it returns None
      for a transfer), ``ReceivedState.store`` holds the verified objects.
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
    self._active: dict[str, Inbound] = {}
    # sender_id -> its SenderClock, while a transfer of it holds the clock.
    self._sender_clocks: weakref.WeakValueDictionary[str, SenderClock] = (
        weakref.WeakValueDictionary())
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
    # Set by serve_receiver when it also starts a TCP data plane (and lets it
    # carry Begin / Commit).
    self.data_plane_port = 0
    self.data_plane_control = False

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

  def _release(self, t: Inbound) -> None:
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

  def _fail(self, t: Inbound, code: grpc.StatusCode, message: str) -> bool:
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

  def _get(self, tid: str) -> Inbound:
    with self._lock:
      t = self._active.get(tid)
      if t is not None:
        return t
      failed = self._failures.get(tid)
    if failed is not None:
      raise TransferFailed(failed[0], f"transfer {tid} already failed: {failed[1]}")
    raise TransferFailed(Code.NOT_FOUND, f"no transfer {tid!r} in progress (never begun, "
                                  "already committed, or reaped)")

  def _reserve(self, t: Inbound, nbytes: int) -> None:
    """Grows the transfer's reservation to cover ``nbytes`` more held bytes."""
    with self._lock:
      need = t.held + nbytes - t.reserved
      if need > 0:
        if self._reserved_total + need > self.options.byte_budget:
          raise TransferFailed(Code.RESOURCE_EXHAUSTED,
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
        elif now - t.idle_since() > self.options.idle_timeout_s:
          # The sender's clock: a frame of any of its transfers keeps the others
          # alive (one queued behind another's bytes on a slow link is not idle).
          self._fail(t, Code.DEADLINE_EXCEEDED,
                     f"no frame of this transfer or its sender for "
                     f"{self.options.idle_timeout_s:g} s (sender hung or gone)")

  # -- RPCs --------------------------------------------------------------------------

  def Begin(self, request, context):
    try:
      return self._begin(request, context.peer())
    except TransferFailed as e:
      context.abort(e.code, e.message)

  def _begin(self, request, peer: str, repeated: bool = False) -> transport_pb2.BeginResponse:
    """Begin over gRPC or the data plane. ``repeated``: a data-plane BEGIN
    sent again after its connection was lost unanswered; if this receiver
    already began that very request, it answers as it did (the id is not
    "already used" by anyone else). Raises TransferFailed."""
    tid = request.transfer_id
    if not tid:
      raise TransferFailed(Code.INVALID_ARGUMENT, "Begin: empty transfer_id")
    want = self.models.get(request.model_id)
    if want is None:
      raise TransferFailed(Code.FAILED_PRECONDITION,
                    f"this decode process does not serve model {request.model_id!r} "
                    f"(serves {sorted(self.models)})")
    if want != request.config_fingerprint:
      raise TransferFailed(Code.FAILED_PRECONDITION,
                    f"config fingerprint mismatch for model {request.model_id!r}: sender has "
                    f"{request.config_fingerprint}, this decode process has {want}")
    try:
      codec = CodecOptions.from_json(request.codec_json) if request.codec_json else CodecOptions()
    except (ValueError, TypeError) as e:
      raise TransferFailed(Code.INVALID_ARGUMENT, f"Begin: bad codec_json: {e}") from None
    info = TransferInfo(transfer_id=tid, model_id=request.model_id,
                        config_fingerprint=request.config_fingerprint,
                        num_layers=int(request.num_layers), token_count=int(request.token_count),
                        codec=codec, peer=peer, sender_id=request.sender_id[:128])
    template = None
    if self.template is not None:
      try:
        template = self.template(info)
      except Exception as e:
        raise TransferFailed(Code.FAILED_PRECONDITION,
                      f"no decode template for this transfer: {e}") from None
    if template is not None:  # None: keep this transfer's objects, restore nothing
      like_layers, _ = layout.split_state(template[0])
      if len(like_layers) != info.num_layers:
        raise TransferFailed(Code.INVALID_ARGUMENT,
                      f"Begin announces {info.num_layers} layers, the decode model has "
                      f"{len(like_layers)}")
    now = time.monotonic()
    t = Inbound(info, template, now, now + self.options.transfer_timeout_s)
    t.begin_request = request
    response = transport_pb2.BeginResponse(max_frame_bytes=self.options.max_message_bytes,
                                           data_plane_port=self.data_plane_port,
                                           data_plane_control=self.data_plane_control)
    with self._lock:
      began = self._active.get(tid)
      if repeated and began is not None and began.begin_request == request:
        t.store.close()
        return response
      if info.sender_id:
        clock = self._sender_clocks.get(info.sender_id)
        if clock is None:
          clock = self._sender_clocks[info.sender_id] = SenderClock(now)
        t.sender_clock = clock
        clock.last = now
      if tid in self._active or tid in self._failures or tid in self._timelines:
        t.store.close()
        raise TransferFailed(Code.ALREADY_EXISTS, f"transfer id {tid!r} was already used")
      reserve = int(request.reserve_bytes)
      if self._reserved_total + reserve > self.options.byte_budget:
        t.store.close()
        raise TransferFailed(Code.RESOURCE_EXHAUSTED,
                      f"receiver byte budget full: {self._reserved_total} of "
                      f"{self.options.byte_budget} bytes in use, transfer reserves {reserve}")
      t.reserved = reserve
      self._reserved_total += reserve
      self._active[tid] = t
    return response

  def _adopt_descriptor(self, t: Inbound, entry: LayerEntry, raw: tuple[dict, str] | None,
                        layer_index: int) -> None:
    """``raw``: the descriptor's (parsed JSON, text); None: a group of Commit's manifest."""
    check_descriptor(t, entry, layer_index)
    with t.lock:
      old = t.descriptors.get(entry.index)
      if old is entry or old == entry:
        return
      if old is not None and entry.index in t.flushed:
        raise TransferFailed(Code.INVALID_ARGUMENT,
                      f"layer {entry.index} changed after all its chunks had arrived")
      t.descriptors[entry.index] = entry
      if raw is None:
        t.descriptor_json.pop(entry.index, None)
      else:
        t.descriptor_json[entry.index] = raw
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

  def _accept_chunk(self, t: Inbound, layer: int, key: str, crc: int, nbytes: int,
                    data, data_crc: int | None = None) -> tuple[str | None, int]:
    """Verifies one object (gRPC frame or data-plane buffer) and keeps ``data``.
    ``data_crc``: the crc32c of ``data`` if the caller computed it as the bytes
    arrived (the data plane); None: computed here."""
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
      got = crc32c(data) if data_crc is None else data_crc
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
          raise TransferFailed(Code.DATA_LOSS, f"{location(layer, key)} failed verification "
                                        f"{t.attempts[key]} times; last: {reason}")
        return reason, len(data)
      if key in t.verified:
        return None, 0  # A resend of something that already arrived intact.
      if t.status == "failed":
        raise TransferFailed(*(self.failure(t.info.transfer_id)
                               or (Code.ABORTED, "transfer failed")))
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

  def _maybe_complete(self, t: Inbound, layer: int) -> None:
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
        t.restores[layer] = self._pool.submit(restore_layer, t, t.store, entry, like,
                                              shardings)

  def Commit(self, request, context):
    try:
      return self._commit(request)
    except TransferFailed as e:
      context.abort(e.code, e.message)

  def _commit(self, request) -> transport_pb2.CommitResponse:
    """Commit over gRPC or the data plane. Raises TransferFailed (the transfer failed
    unless it is a RpcRefused)."""
    t = None
    try:
      t = self._get(request.transfer_id)
      try:
        manifest = manifest_from_descriptors(request.manifest_json, t)
        if manifest is None:
          with t.lock:
            known = {i: (raw, t.descriptors[i]) for i, (raw, _) in t.descriptor_json.items()}
          manifest = StateManifest.from_json(request.manifest_json, known)
      except (ValueError, KeyError, TypeError) as e:
        raise TransferFailed(Code.INVALID_ARGUMENT, f"Commit: bad manifest: {e}") from None
      info = t.info
      if (manifest.model_id, manifest.config_fingerprint) != (info.model_id,
                                                              info.config_fingerprint):
        raise TransferFailed(Code.FAILED_PRECONDITION,
                      f"manifest is for {manifest.model_id!r}/{manifest.config_fingerprint}, "
                      f"Begin announced {info.model_id!r}/{info.config_fingerprint}")
      if len(manifest.layers) != info.num_layers:
        raise TransferFailed(Code.INVALID_ARGUMENT, f"manifest has {len(manifest.layers)} layers, "
                                             f"Begin announced {info.num_layers}")
      for group in manifest.groups:
        self._adopt_descriptor(t, group, None, group.index)
      with t.lock:
        missing = [transport_pb2.ChunkStatus(layer_index=g.index, key=c.key,
                                             reason="not received intact")
                   for g in manifest.groups for _, c in g.chunks() if c.key not in t.verified]
        if missing:
          return transport_pb2.CommitResponse(complete=False, missing=missing)
        if t.status != "open":
          raise RpcRefused(Code.FAILED_PRECONDITION, f"transfer is already {t.status}")
        t.status = "committing"
      state, store = self._finish_restore(t, manifest)
    except TransferFailed as e:
      if t is not None and not isinstance(e, RpcRefused):
        self._fail(t, e.code, e.message)
      raise
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
      raise RpcRefused(Code.INTERNAL, f"decode side rejected the state: {e}") from None
    return transport_pb2.CommitResponse(complete=True, receiver_ready_s=ready - t.begin_s)

  def _finish_restore(self, t: Inbound, manifest: StateManifest):
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
      raise TransferFailed(Code.INVALID_ARGUMENT, f"state does not fit the decode model: {e}")
    except Exception as e:
      raise TransferFailed(Code.DATA_LOSS, f"restoring the verified state failed: {e!r}")

  def Abort(self, request, context):
    with self._lock:
      t = self._active.get(request.transfer_id)
    existed = t is not None and self._fail(
        t, Code.CANCELLED, f"aborted by sender: {request.reason or 'no reason given'}")
    return transport_pb2.AbortResponse(existed=existed)


__all__ = ["ReceivedState", "ReceiverOptions", "StateReceiver", "TemplateFn", "TransferInfo"]
