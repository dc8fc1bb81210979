"""Cross-cluster prefix-cache transfer (paper section 3.4.3, bandwidth-abundant rule).

When the link is abundant and the longer cached prefix of a prompt sits in the
region that will *not* prefill it, the broker asks that region to ship the
prefix first (``ExportPrefix``, served by both the Prefill and the Decode
service). Both directions use the same two halves:

* ``PrefixExporter`` (the region holding the prefix): looks the prompt up in
  its ``PrefillEngine``'s prefix cache (``HybridPrefixCache.lookup``: the KV
  blocks and the recurrent checkpoint at the matched length, a batch-1
  ``DecodeState``) and streams it with a ``StateSender`` to the other region's
  ``StateReceiver``, through the same emulated WAN route the states take (A->B
  for region A's prefixes, the relay's b_to_a route for region B's). The
  transfer id is ``"prefix:" + transfer_id``; besides ``lengths`` the
  state-level arrays carry ``prefix_tokens`` [L] int32, so the importer needs
  no side channel to learn which tokens the state belongs to. The codec is
  forced exact (no quantization): a prefix cache entry is reused by many
  later requests, which must stay token-exact.
* ``PrefixImporter`` (the other region): gives the receiver the template of a
  prefix transfer (``prefix_template``) and, in the receiver's ``on_ready``
  (which runs before Commit is acknowledged), hands the prefix to
  ``PrefillEngine.import_prefix``. So when ``ExportPrefix`` returns OK the
  prefix is in the importer's cache, or queued to be inserted before the next
  prompt it prefills; either way the request the broker starts next reuses it.

A failed export leaves nothing behind on either side (the receiver drops a
failed transfer), and the broker then just runs the request without the
shipped prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.codec import CodecOptions
from paas_jax.observability.health import FAST_RECONNECT
from paas_jax.proto import serving_pb2
from paas_jax.serving import common
from paas_jax.serving.validation import EngineError
from paas_jax.state import DecodeState, abstract_state, round_up
from paas_jax.transport import LinkCounters, SenderOptions, StateSender, TransferError
from paas_jax.transport.channels import make_channels

log = logging.getLogger("paas_jax.serving.prefix_transfer")

# Transfer ids of prefix transfers; request ids (states for decode) never have it.
PREFIX = "prefix:"
MAX_TRANSFER_ID_CHARS = 256
# Deadline of an export when the caller set none (the broker always sets one).
DEFAULT_EXPORT_TIMEOUT_S = 30.0


def is_prefix_transfer(transfer_id: str) -> bool:
  return transfer_id.startswith(PREFIX)


def wire_id(transfer_id: str) -> str:
  """The StateTransfer id of an export: ``"prefix:" + transfer_id``."""
  return transfer_id if is_prefix_transfer(transfer_id) else PREFIX + transfer_id


def prefix_template(config, token_count: int) -> dict:
  """The receiver's template of a prefix of ``token_count`` tokens (pure).

  ``{"layers": batch-1 layer caches (attention capacity rounded up),
  "lengths": int32 [1], "prefix_tokens": int32 [token_count]}`` as
  ``jax.ShapeDtypeStruct``s; leaf names match the exporter's state plus
  ``prefix_tokens``.
  """
  like = abstract_state(config, 1, round_up(max(token_count, 1)))
  return {"layers": like.layers, "lengths": like.lengths,
          "prefix_tokens": jax.ShapeDtypeStruct((token_count,), jnp.int32)}


class PrefixImporter:
  """Receives prefixes into ``engine``'s prefix cache (see the module docstring).

  ``template``, ``on_ready`` and ``on_failure`` are meant for a
  ``StateReceiver`` (directly, or dispatched by ``is_prefix_transfer``).
  """

  def __init__(self, config, engine, *, metrics=None, link: str = "A->B"):
    self.config = config
    self.engine = engine  # a PrefillEngine with a prefix cache
    self.metrics = metrics
    self.link = link
    self.counters = {"prefix_imports": 0, "prefix_import_tokens": 0,
                     "prefix_import_bytes": 0, "prefix_imports_failed": 0}

  def template(self, info) -> tuple[Any, None]:
    """(template, shardings) for a prefix transfer; ValueError refuses it at Begin."""
    if not is_prefix_transfer(info.transfer_id):
      raise ValueError(f"transfer {info.transfer_id!r} is not a prefix transfer "
                       f"(ids start with {PREFIX!r}); this port only imports prefixes")
    cache = getattr(self.engine, "prefix_cache", None)
    if cache is None:
      raise ValueError("this server has no prefix cache to import into")
    n = int(info.token_count)
    if n <= 0 or n % cache.block_size or n >= self.engine.max_ctx:
      raise ValueError(f"a prefix of {n} tokens cannot be cached here (whole "
                       f"{cache.block_size}-token blocks, below the context of "
                       f"{self.engine.max_ctx})")
    return prefix_template(self.config, n), None

  def on_ready(self, received) -> None:
    """Inserts a committed prefix; raising makes Commit fail (the export sees it)."""
    st = received.state
    tokens = np.asarray(st["prefix_tokens"]).astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
      raise ValueError("prefix_tokens outside the vocabulary")
    state = DecodeState(layers=tuple(st["layers"]), lengths=st["lengths"])
    self.engine.import_prefix(tokens.tolist(), state)
    self.counters["prefix_imports"] += 1
    self.counters["prefix_import_tokens"] += int(tokens.size)
    self.counters["prefix_import_bytes"] += int(received.manifest.nbytes)
    if self.metrics is not None:
      self.metrics.link_transfers.labels(self.link, "prefix_received").inc()
    log.info("prefix imported", extra={"transfer_id": received.info.transfer_id,
                                       "tokens": int(tokens.size),
                                       "state_bytes": int(received.manifest.nbytes)})

  def on_failure(self, transfer_id: str, code, message: str) -> None:
    self.counters["prefix_imports_failed"] += 1
    if self.metrics is not None:
      self.metrics.link_transfers.labels(self.link, "prefix_receive_failed").inc()
    log.info("prefix import %s failed: %s %s", transfer_id, getattr(code, "name", code), message)

  def gauges(self) -> dict:
    return dict(self.counters)


class PrefixExporter:
  """Serves ``ExportPrefix`` for ``engine``'s prefix cache (see the module docstring).

  Senders (one per target, reused) are made on first use with
  ``credentials`` (mutual TLS with this server's certificate, or None). They
  report into ``link_counters`` (a ``LinkCounters`` of ``link``; default its own,
  region A passes its state senders' so one set of ``link_*`` gauges covers
  everything it sends over the link).
  """

  def __init__(self, config, engine, *, codec=None, sender_options=None,
               credentials: grpc.ChannelCredentials | None = None, metrics=None,
               link: str = "A->B", link_counters=None):
    self.config = config
    self.engine = engine
    # Exact: the entry is reused by many later prompts, which must stay token-exact.
    self.codec = dataclasses.replace(codec or CodecOptions(), quantization="none")
    self.sender_options = sender_options or SenderOptions(num_streams=2, rpc_timeout_s=5.0,
                                                          commit_timeout_s=60.0,
                                                          transfer_timeout_s=120.0)
    self.credentials = credentials
    self.metrics = metrics
    self.link = link
    self.link_counters = link_counters if link_counters is not None else LinkCounters(link)
    self._senders: dict[str, Any] = {}
    self._channels: list[grpc.Channel] = []
    self._lock = threading.Lock()
    self.counters = {"prefix_exports": 0, "prefix_export_tokens": 0,
                     "prefix_export_bytes": 0, "prefix_exports_failed": 0}

  def _sender(self, target: str):
    with self._lock:
      sender = self._senders.get(target)
      if sender is None:
        opts = dataclasses.replace(self.sender_options, credentials=self.credentials)
        chans = make_channels(target, opts.num_connections,
                              max_message_bytes=opts.max_message_bytes,
                              credentials=opts.credentials, extra_options=FAST_RECONNECT)
        self._channels.extend(chans)
        sender = StateSender(channels_=chans, options=opts, counters=self.link_counters)
        self._senders[target] = sender
      return sender

  def close(self) -> None:
    with self._lock:
      for s in self._senders.values():
        s.close()
      for c in self._channels:
        c.close()
      # Idempotent: a PD node's Prefill servicer shares (and also closes) it.
      self._senders.clear()
      self._channels.clear()

  def gauges(self) -> dict:
    return dict(self.counters)

  @staticmethod
  def check_request(request, config) -> list[int]:
    """The prompt of a valid ``ExportPrefixRequest``; ValueError names the bad field."""
    if request.model and request.model != config.name:
      raise ValueError(f"unknown model {request.model!r}; this server serves {config.name!r}")
    tid = request.transfer_id
    if not tid or len(tid) > MAX_TRANSFER_ID_CHARS or not tid.isprintable():
      raise ValueError(f"transfer_id is required (at most {MAX_TRANSFER_ID_CHARS} printable "
                       "characters)")
    if not request.target:
      raise ValueError("target (the importer's StateTransfer host:port) is required")
    if request.max_tokens < 0:
      raise ValueError(f"max_tokens must be >= 0, got {request.max_tokens}")
    prompt = [int(t) for t in request.prompt_ids]
    if not prompt:
      raise ValueError("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= config.vocab_size:
      raise ValueError(f"prompt_ids outside the vocabulary [0, {config.vocab_size})")
    return prompt

  def serve(self, request, context) -> serving_pb2.ExportPrefixResponse:
    """The ``ExportPrefix`` RPC body (Prefill and Decode services)."""
    try:
      prompt = self.check_request(request, self.config)
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ExportPrefix: {e}")
    if getattr(self.engine, "prefix_cache", None) is None:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    "ExportPrefix: this server has no prefix cache (--prefix_block=0)")
    t0 = time.perf_counter()
    budget = common.remaining_s(context, DEFAULT_EXPORT_TIMEOUT_S)
    try:
      matched, state = self.engine.export_prefix(prompt, int(request.max_tokens),
                                                 timeout_s=budget)
    except TimeoutError as e:
      context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"ExportPrefix: {e}")
    except EngineError as e:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ExportPrefix: {e}")
    if state is None:
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f"ExportPrefix: no cached prefix of this {len(prompt)}-token prompt"
                    + (f" (at most {request.max_tokens} tokens)" if request.max_tokens else ""))
    tid = wire_id(request.transfer_id)
    holder: dict = {"done": False}

    def on_rpc_done():
      # The caller went away or its deadline passed: stop the transfer, so the
      # importer drops what it received instead of caching it.
      tx = holder.get("tx")
      if not holder["done"] and tx is not None:
        tx.abort("the caller cancelled the prefix export")
    context.add_callback(on_rpc_done)
    try:
      sender = self._sender(request.target)
      tx = sender.begin(model_id=self.config.name,
                        config_fingerprint=self.config.fingerprint(),
                        num_layers=len(state.layers), lengths=[matched], codec=self.codec,
                        transfer_id=tid)
      holder["tx"] = tx
      for i, layer in enumerate(state.layers):
        tx.send_layer(i, layer)
      result = tx.finish(state_arrays=[
          ("lengths", np.asarray([matched], np.int32)),
          ("prefix_tokens", np.asarray(prompt[:matched], np.int32))])
      holder["done"] = True
    except TransferError as e:
      self.counters["prefix_exports_failed"] += 1
      self._observe(None, ok=False)
      context.abort(e.code, f"ExportPrefix: prefix transfer to {request.target} failed: "
                            f"{e.message}")
    except ValueError as e:  # e.g. a malformed target address
      self.counters["prefix_exports_failed"] += 1
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ExportPrefix: target "
                                                      f"{request.target!r}: {e}")
    tl = result.timeline
    self.counters["prefix_exports"] += 1
    self.counters["prefix_export_tokens"] += matched
    self.counters["prefix_export_bytes"] += tl.bytes_sent
    self._observe(tl, ok=True)
    log.info("prefix exported", extra={"transfer_id": tid, "target": request.target,
                                       "tokens": matched, "bytes_sent": tl.bytes_sent,
                                       "seconds": round(time.perf_counter() - t0, 4)})
    return serving_pb2.ExportPrefixResponse(tokens=matched, state_bytes=tl.state_bytes,
                                            bytes_sent=tl.bytes_sent,
                                            transfer_s=tl.duration_s or 0.0)

  def _observe(self, tl, ok: bool) -> None:
    if self.metrics is None:
      return
    self.metrics.observe_transfer(self.link, bytes_sent=tl.bytes_sent if tl else 0,
                                  state_bytes=tl.state_bytes if tl else 0,
                                  seconds=(tl.duration_s or 0.0) if tl else 0.0, ok=ok)
