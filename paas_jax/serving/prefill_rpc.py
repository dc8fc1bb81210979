"""One ``Prefill`` RPC of the prefill server, from validation to ``TransferDone``.

For each request: queue for a prefill batch -> open a transfer to the decode
server the broker chose when the batch starts (a ``ChunkStreamer`` of
segments with commit points, or one layer-pipelined ``StateSender`` transfer)
-> prefill, each computed layer/chunk handed to the transfer -> report the
first token (with its logit probe) -> commit -> report bytes and time. A
cancelled RPC aborts the transfer; a preemption ends it at its commit point.
The servicer (``prefill_server.PrefillServicer``) owns the engine, batcher,
senders and counters this uses.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import time

import grpc

from paas_jax.codec import CodecOptions
from paas_jax.proto import serving_pb2
from paas_jax.scheduling.tenant_queue import DEFAULT_TENANT
from paas_jax.serving import handoff_probe, logprobs
from paas_jax.serving.chunk_stream import ChunkStreamer, StreamResult
from paas_jax.serving.prefill_batcher import PrefillJob
from paas_jax.serving.prefill_engine import PrefillInput
from paas_jax.serving.resume_preempt import PreemptedError
from paas_jax.serving.validation import (EngineError, InvalidRequestError, RequestParams,
                                         check_request_identity, make_sampling,
                                         requested_logprobs, validate_request)
from paas_jax.transport import TransferError

log = logging.getLogger("paas_jax.serving.prefill")
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def serve_prefill(srv, request, context):
  """One ``Prefill`` RPC of ``srv`` (a ``PrefillServicer``): validate, queue the
  prefill job, open its transfer when the batch starts, stream the events."""
  try:
    check_request_identity(request, srv.config, "prefill server")
    if not request.decode_target:
      raise InvalidRequestError("decode_target is required")
    prompt = tuple(int(t) for t in request.prompt_ids)
    params = RequestParams(
        sampling=make_sampling(request.sampling.temperature, request.sampling.top_k,
                               request.sampling.top_p),
        seed=int(request.seed), max_new_tokens=1,
        logprobs=requested_logprobs(request.logprobs, request.top_logprobs))
    validate_request(srv.config, prompt, params, srv.engine.max_ctx)
    codec = CodecOptions.from_json(request.codec_json) if request.codec_json else srv.codec
    if not 0 <= request.decode_held_tokens < len(prompt):
      raise InvalidRequestError(f"decode_held_tokens must be in [0, {len(prompt)}), got "
                                f"{request.decode_held_tokens}")
    if request.tenant and not TENANT_NAME.fullmatch(request.tenant):
      raise InvalidRequestError(f"tenant must match {TENANT_NAME.pattern}, got "
                                f"{request.tenant[:40]!r}")
  except (InvalidRequestError, ValueError) as e:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
  if request.HasField("decode_slice"):
    # A slice takes per-process shard parts, never a whole state (pod_transfer).
    context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                  "this prefill server sends whole states to one decode process; a decode "
                  "slice of several processes is served by a prefill pod (pod_prefill_server)")

  events: queue.Queue = queue.Queue()
  holder: dict = {}
  submitted = time.perf_counter()
  rid = request.request_id
  cfg = srv.config
  tenant = request.tenant or DEFAULT_TENANT
  # Each tenant's states cross its own link: egress is accounted per link.
  link = srv.link_label if tenant == DEFAULT_TENANT else f"A->{tenant}"

  def on_start():
    if srv.faults is not None:
      holder["transfer_no"] = srv.faults.transfer_started()
    sender = srv.sender_for(request.decode_target)
    if srv.stream_chunks:
      # The decode side's own prefix [0, held) is not sent (chunk_stream).
      held = int(request.decode_held_tokens)
      holder["tx"] = ChunkStreamer(sender, cfg, rid, len(prompt),
                                   chunk=srv.engine.config.prefill_chunk,
                                   commit_every=srv.commit_every, codec=codec,
                                   on_commit=on_commit, held=held)
      if held:
        srv.counters["held_requests"] += 1
        srv.counters["held_tokens_not_sent"] += held
        holder["commits"] = 1
        events.put(("commit", held, 1))  # the decode side holds it from the start
    else:
      holder["tx"] = sender.begin(model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                                  num_layers=cfg.n_layers, lengths=[len(prompt)],
                                  codec=codec, transfer_id=rid)
    holder["queue_s"] = time.perf_counter() - submitted

  def layer_fault():
    if srv.faults is not None:
      holder["layers_sent"] = holder.get("layers_sent", 0) + 1
      srv.faults.on_layer(holder["transfer_no"], holder["layers_sent"])

  def on_layer(i, cache):
    holder["tx"].send_layer(i, cache)
    layer_fault()

  def on_chunk(i, cache, start, end, row):
    holder["tx"].put(i, cache, start, end, row)
    layer_fault()

  def on_commit(tokens):
    holder["commits"] = holder.get("commits", 0) + 1
    events.put(("commit", tokens, holder["commits"]))
    if srv.faults is not None and tokens < len(prompt):
      holder["partial_commits"] = holder.get("partial_commits", 0) + 1
      srv.faults.on_commit(holder["transfer_no"], holder["partial_commits"])

  def on_done(out):
    events.put(("first", out))
    srv.finishers.submit(finish)

  def finish():
    tx = holder.get("tx")
    try:
      try:
        if srv.stream_chunks:
          result = _stream_outcome(tx.close(), request.decode_target)
        else:
          result = tx.finish()
      finally:
        # Prefix-cache entries made only for this transfer go once it is over.
        srv.release_prefix(rid)
    except TransferError as e:
      srv.counters["transfers_failed"] += 1
      if srv.metrics is not None:
        tl = tx.timeline()
        srv.metrics.observe_transfer(link, bytes_sent=tl.bytes_sent,
                                      state_bytes=0, seconds=0.0, ok=False,
                                      retried_chunks=tl.resent_chunks)
      events.put(("error", e.code, f"state transfer to {request.decode_target} failed: "
                                   f"{e.message}"))
      return
    except Exception as e:  # pylint: disable=broad-except
      srv.counters["transfers_failed"] += 1
      events.put(("error", grpc.StatusCode.INTERNAL, f"state transfer failed: {e!r}"))
      return
    srv.counters["transfers_ok"] += 1
    srv.counters["bytes_sent"] += result.timeline.bytes_sent
    srv.counters[f"egress_bytes:{tenant}"] += result.timeline.bytes_sent
    srv.counters[f"egress_transfers:{tenant}"] += 1
    srv.counters["resent_chunks"] += result.timeline.resent_chunks
    if srv.metrics is not None:
      tl = result.timeline
      srv.metrics.observe_transfer(link, bytes_sent=tl.bytes_sent,
                                    state_bytes=tl.state_bytes, seconds=tl.duration_s or 0.0,
                                    retried_chunks=tl.resent_chunks)
    events.put(("done", result))

  def on_error(e):
    tx = holder.get("tx")
    if isinstance(tx, ChunkStreamer):
      tx.abort()
    elif tx is not None:
      tx.abort(f"prefill failed: {e!r}")
    if isinstance(e, TransferError):
      srv.counters["transfers_failed"] += 1
      if srv.metrics is not None:
        tl = tx.timeline() if tx is not None else None
        srv.metrics.observe_transfer(
            link, bytes_sent=tl.bytes_sent if tl else 0, state_bytes=0,
            seconds=0.0, ok=False, retried_chunks=tl.resent_chunks if tl else 0)
    srv.release_prefix(rid)
    if isinstance(e, TransferError):
      events.put(("error", e.code, f"could not open a transfer to "
                                   f"{request.decode_target}: {e.message}"))
    elif isinstance(e, InvalidRequestError):
      events.put(("error", grpc.StatusCode.INVALID_ARGUMENT, str(e)))
    elif isinstance(e, PreemptedError):
      events.put(("error", grpc.StatusCode.UNAVAILABLE, str(e)))
    else:
      events.put(("error", grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}"))

  owner = (rid if srv.engine.prefix_cache is not None and not srv.stream_chunks
           else None)
  job = PrefillJob(input=PrefillInput(rid, prompt, params, cache_owner=owner),
                   on_done=on_done, on_error=on_error, on_start=on_start,
                   on_layer=None if srv.stream_chunks else on_layer,
                   on_chunk=on_chunk if srv.stream_chunks else None, tenant=tenant)

  def on_rpc_done():
    if "finished" not in holder:
      job.cancelled = True
      tx = holder.get("tx")
      if isinstance(tx, ChunkStreamer):
        tx.abort()
      elif tx is not None:
        tx.abort("the broker cancelled the request")
      srv.counters["cancelled"] += 1
  context.add_callback(on_rpc_done)

  def hand_over() -> int:
    """Preempted: end this request's stream at its commit point (the broker
    resumes from it); returns the commit point."""
    job.cancelled = True
    tx = holder.get("tx")
    point = tx.commit_point if isinstance(tx, ChunkStreamer) else 0
    if isinstance(tx, ChunkStreamer):
      tx.abort()
    elif tx is not None:
      tx.abort("prefill node preempted")
    srv.counters["preempted_handed_over"] += 1
    events.put(("error", grpc.StatusCode.UNAVAILABLE,
                f"prefill node preempted; the decode side holds commit point {point} of "
                f"{len(prompt)} tokens"))
    return point
  try:
    srv.preemption.track(rid, hand_over)
  except PreemptedError as e:
    holder["finished"] = True
    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
  try:
    yield from _events(srv, rid, events, holder, job, context, request)
  finally:
    srv.preemption.done(rid)

def _events(srv, rid, events, holder, job, context, request):
  """Queues the job, then streams its events (``Prefill``)."""
  srv.counters["requests"] += 1
  if srv.batcher.queue_depth >= srv.max_queue:
    srv.counters["rejected_queue_full"] += 1
    if srv.metrics is not None:
      srv.metrics.queue_rejections.labels("prefill_wait").inc()
    holder["finished"] = True
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"prefill queue full ({srv.max_queue} prompts waiting)")
  if not srv.batcher.admits(job.tenant):
    srv.counters[f"rejected_quota:{job.tenant}"] += 1
    holder["finished"] = True
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"tenant {job.tenant!r} has its quota of prompts waiting for prefill")
  try:
    srv.batcher.submit(job)
  except EngineError as e:
    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

  while True:
    try:
      kind, *rest = events.get(timeout=0.5)
    except queue.Empty:
      if not context.is_active():
        return
      continue
    if kind == "error":
      holder["finished"] = True
      context.abort(rest[0], rest[1])
    if kind == "commit":
      yield serving_pb2.PrefillEvent(commit=serving_pb2.CommitPoint(tokens=rest[0],
                                                                    segments=rest[1]))
    elif kind == "first":
      out = rest[0]
      probe = _probe(srv, out, context) if srv.logit_probe else None
      if srv.faults is not None:
        srv.faults.before_first_token()
      yield serving_pb2.PrefillEvent(first_token=serving_pb2.FirstToken(
          token_id=out.first_token, queue_s=holder.get("queue_s", 0.0),
          prefill_s=out.prefill_s, batch_size=out.batch_size,
          cached_tokens=out.cached_tokens, probe=probe,
          logprob=(None if out.first_logprob is None else
                   logprobs.to_proto(out.first_logprob, serving_pb2.TokenLogprob))))
    elif kind == "done":
      t = rest[0].timeline
      holder["finished"] = True
      log.info("state transfer committed", extra={
          "transfer_id": rid, "decode_target": request.decode_target,
          "state_bytes": t.state_bytes, "bytes_sent": t.bytes_sent,
          "resent_chunks": t.resent_chunks, "transfer_s": round(t.duration_s or 0.0, 4)})
      yield serving_pb2.PrefillEvent(done=serving_pb2.TransferDone(
          state_bytes=t.state_bytes, bytes_sent=t.bytes_sent,
          transfer_s=t.duration_s or 0.0, receiver_ready_s=t.receiver_ready_s or 0.0,
          num_streams=t.num_streams))
      return

def _probe(srv, out, context):
  """The probe of ``out``'s state (one decode step, in this RPC's thread: it
  overlaps the state transfer, not the next prefill batch)."""
  t0 = time.perf_counter()
  try:
    probe = handoff_probe.make(srv.model, out)
  except Exception as e:  # pylint: disable=broad-except
    log.exception("logit probe of %s failed", out.request_id)
    context.abort(grpc.StatusCode.INTERNAL, f"computing the logit probe failed: {e!r}")
  srv.probe_s_total += time.perf_counter() - t0
  srv.counters["probes"] += 1
  return probe


@dataclasses.dataclass(frozen=True)
class _StreamOutcome:
  """A whole chunk-streamed prompt as one transfer (what TransferDone reports)."""

  timeline: StreamResult


def _stream_outcome(result: StreamResult, target: str) -> _StreamOutcome:
  """Raises ``TransferError`` (the first failed segment's code) unless every
  segment committed, i.e. the decode side holds the whole prompt."""
  if result.ok:
    return _StreamOutcome(result)
  failed = [r for r in result.segments if not r.ok]
  code = grpc.StatusCode[failed[0].code] if failed and failed[0].code else (
      grpc.StatusCode.UNAVAILABLE)
  why = failed[0].error if failed else "the stream ended before the last segment"
  raise TransferError(code, f"segment stream to {target} stopped at commit point "
                      f"{result.commit_point} of {result.prompt_len} tokens: {why}")

