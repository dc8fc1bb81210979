"""The typed control plane of the servers: ``GetLoad``, ``ProbePrefix``, ``GetModel``.

``serving.proto`` is the contract (``LoadReport``, ``PrefixProbeRequest``).
What the broker steers by (queue depths, decode slots, the link a server's
senders use, its prefix cache, the cached prefix of a prompt) travels in these
typed messages; ``GetStats`` (a gauge map plus JSON) is for people and
Prometheus only, and the broker reads no gauge by key.

* Server side: ``load_report`` builds a server's ``LoadReport`` from its
  queues, link counters and prefix cache; ``probe_prefix`` answers
  ``ProbePrefix`` from a ``PrefillEngine``'s prefix cache (ids or block hashes).
* ``served_model`` builds a ``GetModel`` answer (``ServedModel``: the model's
  name, fingerprint, config, context, tokenizer kind, chat template) on a PD
  node or the broker.
* Broker side: ``check_load_report`` refuses a malformed report before the
  live view (``live_view.LiveClusterState``) or the node pool take it;
  ``model_config`` reads a ``ServedModel``'s config back and checks it
  against the fingerprint the server announced.

JAX-free: the broker imports it (``paas_jax.state`` is imported only inside
``probe_prefix``, which runs in the servers).
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

import grpc

from paas_jax.models import ModelConfig
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common

PREFILL = "prefill"
DECODE = "decode"
# Transfers listed per LinkLoad (the largest pending first).
MAX_LINK_TRANSFERS = 64


class InvalidLoadReport(ValueError):
  """A ``LoadReport`` the broker does not act on (the message says why)."""


class InvalidServedModel(ValueError):
  """A ``ServedModel`` whose config cannot be used (the message says why)."""


# -- server side ----------------------------------------------------------------------

def link_load(counters) -> serving_pb2.LinkLoad:
  """``LinkLoad`` of a ``paas_jax.transport.LinkCounters`` (its label, gauges and
  in-flight transfers)."""
  g = counters.gauges()
  rows = counters.transfers(MAX_LINK_TRANSFERS)
  return serving_pb2.LinkLoad(
      link=counters.label, bytes_pending=max(int(g["link_bytes_pending"]), 0),
      bytes_sent_total=int(g["link_bytes_sent_total"]),
      tcp_retransmits_total=int(g.get("link_tcp_retransmits_total", 0)),
      transfers_active=int(g["link_transfers_active"]),
      transfers=[serving_pb2.LinkTransferLoad(
          transfer_id=tid, pending_bytes=max(int(r["pending"]), 0),
          sent_bytes=int(r["sent"]), encoded=bool(r["encoded"])) for tid, r in rows.items()])


def prefix_cache_info(engine) -> serving_pb2.PrefixCacheInfo:
  """The ``PrefixCacheInfo`` of a ``PrefillEngine`` (disabled without a cache)."""
  cache = engine.prefix_cache
  if cache is None:
    return serving_pb2.PrefixCacheInfo(enabled=False)
  return serving_pb2.PrefixCacheInfo(enabled=True, block_tokens=int(cache.block_size),
                                     config_fingerprint=cache.config.fingerprint())


def load_report(server: str, *, engine, link_counters, prefill_queue_depth: int,
                prefill_queue_limit: int, decode_stats: dict | None = None
                ) -> serving_pb2.LoadReport:
  """A region server's ``LoadReport``.

  Args:
    server: ``PREFILL`` or ``DECODE``.
    engine: its ``PrefillEngine`` (a PD node's PD-P engine), for the prefix cache.
    link_counters: the ``LinkCounters`` of its WAN sends.
    prefill_queue_depth / prefill_queue_limit: prompts waiting for a prefill
      batch, and the limit past which Prefill is refused.
    decode_stats: a PD node's ``DecodeScheduler.stats()`` (None on a prefill server).
  """
  d = decode_stats or {}
  return serving_pb2.LoadReport(
      server=server, prefill_queue_depth=int(prefill_queue_depth),
      prefill_queue_limit=int(prefill_queue_limit),
      decode_slots_total=int(d.get("slots_total", 0)),
      decode_slots_busy=int(d.get("slots_busy", 0)), decode_waiting=int(d.get("waiting", 0)),
      link=link_load(link_counters), prefix_cache=prefix_cache_info(engine))


def probe_prefix(engine, request, context) -> serving_pb2.PrefixProbeResponse:
  """``ProbePrefix``: the longest prefix of the probed prompt the engine's prefix
  cache (``engine.prefix_cache``: a ``PrefillEngine``'s, a ``SlicePrefix``'s, or
  None) would reuse; aborts with the status ``serving.proto`` names."""
  # Deferred: paas_jax.state loads JAX; the broker imports this module, the
  # servers (which have JAX loaded already) call this function.
  from paas_jax.state.prefix_cache import HASH_BYTES  # pylint: disable=g-import-not-at-top
  ids, hashes, block = request.prompt_ids, request.block_hashes, request.block_tokens
  hashed = bool(hashes) or block != 0
  if hashed and ids:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  "ProbePrefix: give prompt_ids or block_hashes, not both")
  if not hashed and not ids:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  "ProbePrefix: give prompt_ids or block_hashes")
  if hashed:
    if block <= 0:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"ProbePrefix: block_tokens must be > 0 with block_hashes, got {block}")
    bad = next((i for i, h in enumerate(hashes) if len(h) != HASH_BYTES), None)
    if bad is not None:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"ProbePrefix: block_hashes[{bad}] has {len(hashes[bad])} bytes, "
                    f"not {HASH_BYTES}")
  cache = engine.prefix_cache
  if cache is None:
    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                  "ProbePrefix: this server has no prefix cache")
  if hashed and block != cache.block_size:
    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                  f"ProbePrefix: block_tokens is {block} but this server's prefix cache "
                  f"uses {cache.block_size}-token blocks")
  tokens = cache.probe_hashes(list(hashes)) if hashed else cache.probe(list(ids))
  return serving_pb2.PrefixProbeResponse(cached_tokens=int(tokens))


def served_model(config, *, max_model_len: int, text=None) -> serving_pb2.ServedModel:
  """The ``GetModel`` answer for ``config`` (a ``paas_jax.models.ModelConfig``).

  ``text``: the broker's ``tokenizer.ServedText`` (served name, tokenizer
  kind, chat template, special tokens, EOS ids); None on a PD node, which
  answers the config's name and no text fields.
  """
  msg = serving_pb2.ServedModel(
      name=text.name if text is not None else config.name,
      config_fingerprint=config.fingerprint(), config_json=json.dumps(config.to_dict()),
      vocab_size=int(config.vocab_size), max_model_len=int(max_model_len))
  if text is not None:
    msg.tokenizer = text.kind
    msg.chat_template = text.chat_template or ""
    msg.special_tokens.update({str(k): str(v) for k, v in text.special_tokens.items()})
    msg.eos_token_ids.extend(int(t) for t in text.eos_token_ids)
  return msg


# -- broker side ------------------------------------------------------------------------

def model_config(served: serving_pb2.ServedModel, from_dict: Callable[[dict], object]):
  """The ``ModelConfig`` of a ``GetModel`` answer, built by ``from_dict``
  (``ModelConfig.from_dict``; passed in so that this module stays JAX-free).
  Raises ``InvalidServedModel`` for a missing or unreadable config, or one
  whose fingerprint is not the one the server announced."""
  if not served.config_json:
    raise InvalidServedModel(f"server answered model {served.name!r} without its config")
  try:
    config = from_dict(json.loads(served.config_json))
  except (ValueError, TypeError, KeyError) as e:
    raise InvalidServedModel(f"config of model {served.name!r} is unreadable: {e}") from None
  if config.fingerprint() != served.config_fingerprint:
    raise InvalidServedModel(
        f"config of model {served.name!r} has fingerprint {config.fingerprint()}, the server "
        f"announced {served.config_fingerprint!r}")
  return config


def check_load_report(report: serving_pb2.LoadReport, server: str) -> None:
  """Raises ``InvalidLoadReport`` unless ``report`` is a well-formed answer of a
  ``server`` ("prefill" or "decode") region server (the rules in serving.proto).
  A report without ``link`` passes: the caller treats its link as unmeasured."""
  if report.server != server:
    raise InvalidLoadReport(f"a {server} server answered as {report.server!r}")
  counts = {"prefill_queue_depth": report.prefill_queue_depth,
            "prefill_queue_limit": report.prefill_queue_limit,
            "decode_slots_total": report.decode_slots_total,
            "decode_slots_busy": report.decode_slots_busy,
            "decode_waiting": report.decode_waiting}
  negative = [f"{k}={v}" for k, v in counts.items() if v < 0]
  if negative:
    raise InvalidLoadReport(f"negative counts: {', '.join(negative)}")
  if report.decode_slots_busy > report.decode_slots_total:
    raise InvalidLoadReport(f"{report.decode_slots_busy} busy decode slots of "
                            f"{report.decode_slots_total}")
  if not report.HasField("prefix_cache"):
    raise InvalidLoadReport("prefix_cache is missing")
  cache = report.prefix_cache
  if cache.enabled and (cache.block_tokens <= 0 or not cache.config_fingerprint):
    raise InvalidLoadReport(f"an enabled prefix cache needs block_tokens > 0 and a "
                            f"config_fingerprint, got {cache.block_tokens} and "
                            f"{cache.config_fingerprint!r}")
  if report.HasField("link") and any(not t.transfer_id for t in report.link.transfers):
    raise InvalidLoadReport("a link transfer without transfer_id")


def probe_request(prompt: Sequence[int] = (), *, hashes: Sequence[bytes] = (),
                  block_tokens: int = 0) -> serving_pb2.PrefixProbeRequest:
  """A ``PrefixProbeRequest`` by ids (``prompt``) or by block hashes."""
  if hashes:
    return serving_pb2.PrefixProbeRequest(block_hashes=list(hashes), block_tokens=block_tokens)
  return serving_pb2.PrefixProbeRequest(prompt_ids=list(prompt))


def served_model_of(target: str, credentials: grpc.ChannelCredentials | None = None
                    ) -> serving_pb2.ServedModel:
  """A decode server's ``GetModel`` answer (its config, and its slice if it is one)."""
  with common.make_channel(target, credentials) as ch:
    return serving_pb2_grpc.DecodeStub(ch).GetModel(serving_pb2.ModelRequest(),
                                                    timeout=common.CONTROL_TIMEOUT_S)


def model_config_from_decode(target: str, credentials: grpc.ChannelCredentials | None = None):
  """The served model's config as a decode server reports it (``GetModel``; a
  broker serving a checkpoint). Raises ``InvalidServedModel`` for a config
  that does not match the fingerprint the server announced."""
  return model_config(served_model_of(target, credentials), ModelConfig.from_dict)
