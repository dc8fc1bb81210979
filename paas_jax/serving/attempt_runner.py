"""How one request's attempts run: pick nodes, prefill, transfer, relay, retry.

``AttemptRunner.run`` drives a routed request through its attempts
(``request_lifecycle``: phases, attempts, failure causes, retry policy). Per
attempt it asks the ``NodePool`` for nodes and runs one of three shapes:

  colocated (route pdp, one PD node prefills and decodes):
    ``Decode.Decode(prompt)`` -> tokens.
  remote (route prfaas, or pdp split over a PD-P and a PD-D node):
    1. ``Decode.Decode(remote_prefill)`` -> accepted (admission control first,
       so a full pool answers RESOURCE_EXHAUSTED before any prefill work);
    2. ``Prefill.Prefill(decode_target)``: the prefill node computes the state
       and streams it to the decode node's StateTransfer port (over the WAN
       for PrfaaS, inside region B for PD-P);
    3. on ``FirstToken``: ``Decode.Handoff(first_token)`` (a follower thread
       reads the Prefill stream; phase TRANSFERRING, then WAITING_FOR_STATE
       once the Handoff is answered); the decode node inserts the request once
       state and token are both there (its slot event: DECODING);
       ``CommitPoint`` events tell how much of
       the prompt region B holds verified (a failed attempt resumes from it:
       ``resume.py``);
    4. tokens flow back on the Decode stream (``_relay``); ``TransferDone``
       gives link bytes/time.

A failed attempt raises ``AttemptFailed`` with a ``FailureCause``;
``retry_decision`` says whether and how it is tried again (another prefill
node or PD-P; a restart on another decode node, the tokens already sent
regenerated identically and checked, not resent).
"""

from __future__ import annotations

import collections
import logging
import threading

import grpc

from paas_jax.observability.logs import request_metadata
from paas_jax.proto import serving_pb2
from paas_jax.serving import common, logprobs
from paas_jax.serving.node_pool import NodeKind, NodePool
from paas_jax.serving.prefix_shipping import PrefixShipper
from paas_jax.serving.resume import ResumeMetrics, ResumePolicy
from paas_jax.serving.request_lifecycle import (AttemptFailed, FailureCause, RequestPhase,
                                                RetryAction, lost_node, retry_decision)
from paas_jax.serving.request_record import RequestRecord
from paas_jax.serving.routing import PDP, PRFAAS
from paas_jax.serving.validation import RequestParams

log = logging.getLogger("paas_jax.serving.broker")
Code = grpc.StatusCode


def sampling_msg(params: RequestParams) -> serving_pb2.SamplingParams:
  s = params.sampling
  return serving_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def _prefill_side(code: grpc.StatusCode) -> FailureCause:
  """The cause of a failure on a streamed attempt's prefill path: DATA_LOSS
  means the state arrived damaged (a chunk that failed its checksum for good,
  or the logit probe at the handoff), anything else a prefill/transfer fault."""
  return FailureCause.STATE_DAMAGED if code == Code.DATA_LOSS else FailureCause.PREFILL


class AttemptRunner:
  """Runs requests' attempts against the pool's nodes (module docstring).

  ``tokenizer``: the served tokenizer (streamed text), or None. ``live``: the
  broker's live view (link accounting), set once it starts. ``counters`` and
  ``metrics`` are the broker's.
  """

  def __init__(self, pool: NodePool, shipper: PrefixShipper, *, model_name: str,
               codec_json: str, tokenizer, max_attempts: int,
               counters: collections.Counter, metrics=None,
               resume_policy: ResumePolicy | None = None):
    self.pool = pool
    self.shipper = shipper
    self.model_name = model_name
    self.codec_json = codec_json
    self.tokenizer = tokenizer
    self.max_attempts = max(1, max_attempts)
    self.counters = counters
    self.metrics = metrics
    # Resume from a commit point instead of re-prefilling (resume.py).
    self.resume_policy = resume_policy if resume_policy is not None else ResumePolicy()
    self.resume_metrics = ResumeMetrics(metrics.registry) if metrics is not None else None
    self.live = None
    # This broker's decode region as a tenant of a shared prefill pool
    # (PrefillRequest.tenant; "": the pool's default tenant).
    self.tenant = ""

  def run(self, rec: RequestRecord, prompt, params, calls, context):
    """Runs the request's attempts (a generator of GenerateResponse), re-prefilling
    / restarting it after faults (class docstring). ``calls``: the downstream
    calls in flight, which the broker cancels when the client goes away."""
    route = rec.route
    bad_prefill: set[int] = set()
    bad_decode: set[int] = set()
    attempt = 0
    resume = None  # resume.ResumeDecision of this attempt
    while True:
      downstream_id = rec.downstream_id if attempt == 0 else f"{rec.downstream_id}~{attempt}"
      att = rec.lifecycle.begin_attempt(route, downstream_id)
      rec.prefill_error = None
      rec.commit_point = 0  # this attempt's (a resume reads the failed attempt's)
      rec.prefill_done = threading.Event()
      pi = None
      if route == PRFAAS:
        pi = self.pool.pick(NodeKind.PREFILL, bad_prefill)
        if pi is None:
          route = att.route = self._reroute(rec, PDP, "no healthy prefill server",
                                            fallback=True)
      if resume is not None:
        prefer = resume.decode_index
      elif route == PDP and rec.pd_prefix_nodes:  # where the local prefill reuses the prefix
        prefer = self.pool.decode_nodes_reusing(rec.pd_prefix_nodes)
      elif rec.pd_prefix_nodes:  # a decode node holding the prefix is sent only the rest
        prefer = self.pool.decode_nodes_holding(rec.pd_prefix_nodes)
      else:
        prefer = -1
      di = self.pool.pick(NodeKind.DECODE, bad_decode, prefer=prefer, soft=resume is None)
      if resume is not None and di != resume.decode_index:
        resume = None  # the node holding the commit point is gone: a full prefill
      if di is None:
        if pi is not None:
          self.pool.release(NodeKind.PREFILL, pi)
        raise AttemptFailed(Code.UNAVAILABLE, "no healthy decode server in the PD region"
                            + (f" (after: {rec.reroutes[-1]})" if rec.reroutes else ""),
                            FailureCause.DECODE)
      try:
        if attempt == 0:
          self.shipper.ship(rec, prompt, context, route, di, pi, calls)
        if route == PRFAAS:
          yield from self._remote_once(rec, prompt, params, calls, context, downstream_id,
                                       di, pi)
        elif resume is not None:
          rec.resumed_from = resume.earlier_id
          yield from self._local(rec, prompt, params, calls, context, downstream_id, di,
                                 resume_from=resume.earlier_id)
        else:
          yield from self._pd_prefill(rec, prompt, params, calls, context, downstream_id, di)
        return
      except AttemptFailed as e:
        rec.lifecycle.fail_attempt(att, e)
        # Its connection broke: out of routing until a health probe (over the
        # same channel) succeeds again.
        lost = lost_node(e.cause, e.code, rec.client_gone)
        if lost == FailureCause.DECODE:
          self.pool.mark_down(NodeKind.DECODE, di, e.message)
        elif lost == FailureCause.PREFILL and pi is not None:
          self.pool.mark_down(NodeKind.PREFILL, pi, e.message)
        if pi is not None and e.cause != FailureCause.DECODE:
          bad_prefill.add(pi)
        decision = self._retry_decision(rec, e, att, context, route=route, di=di,
                                        bad_prefill=bad_prefill, prompt_len=len(prompt))
        if not decision.retry:
          raise
        attempt += 1
        calls.clear()
        if decision.action == RetryAction.RESTART_ON_OTHER_DECODE:
          bad_decode.add(di)
        resume = decision.resume
        route = self._reroute(rec, decision.route, decision.reason,
                              fallback=decision.fallback)
      finally:
        self.pool.release(NodeKind.DECODE, di)
        if pi is not None:
          self.pool.release(NodeKind.PREFILL, pi)

  def _retry_decision(self, rec: RequestRecord, e: AttemptFailed, att, context, *,
                      route: str, di: int, bad_prefill: set[int], prompt_len: int):
    """``request_lifecycle.retry_decision`` with this request's facts: the
    deadline, the tokens the client has, the healthy nodes and what the resume
    policy says of the failed attempt's commit point on decode node ``di``."""
    others = bool(self.pool.healthy_prefill(exclude=bad_prefill))
    # A node that keeps no commit points (a slice) cannot resume: no offer.
    offer = None if not self.pool.shapes[di].commit_points else self.resume_policy.decide(
        prompt_tokens=prompt_len, commit_point=rec.commit_point,
        earlier_id=att.downstream_id, decode_index=di,
        decode_healthy=self.pool.healthy(NodeKind.DECODE, di), other_prefill=others,
        streamed=route == PRFAAS or rec.pd_split)
    return retry_decision(
        e.cause, e.code, att.number, max_attempts=self.max_attempts,
        client_gone=rec.client_gone, time_left_s=common.remaining_s(context),
        tokens_delivered=len(rec.delivered) - rec.early_tokens,
        other_decode_healthy=self.pool.other_decode_healthy(
            self.pool.decode_index(rec.decode_server)),
        route=route, other_prefill_healthy=others, resume=offer)

  def _reroute(self, rec: RequestRecord, route: str, cause: str, fallback: bool = False) -> str:
    rid = rec.request_id
    log.warning("request %s: %s; retrying (%s)", rid, cause, route, extra={"request_id": rid})
    rec.reroutes.append(f"{cause} -> {route}")
    self.counters["reroutes"] += 1
    if fallback and route == PDP:
      self.counters["fallback_pdp"] += 1
      if "fallback" not in rec.route_reason:
        rec.route_reason += f";fallback:{cause}"
    if self.metrics is not None:
      self.metrics.observe_reroute(cause, route)
    rec.route = route
    rec.lifecycle.advance(RequestPhase.REROUTED)
    rec.prefill_done.set()
    return route

  def _decode_request(self, rec, prompt, params, remote: bool,
                      downstream_id: str, resume_from: str = "") -> serving_pb2.DecodeRequest:
    return serving_pb2.DecodeRequest(
        request_id=downstream_id, model=self.model_name,
        # A remote request's prompt too: the decode node looks it up in its own
        # prefix cache and holds what it has (DecodeEvent.held_tokens).
        prompt_ids=prompt, remote_prefill=remote, prompt_len=len(prompt),
        sampling=sampling_msg(params), seed=params.seed,
        max_new_tokens=params.max_new_tokens, stop_tokens=list(params.stop_tokens),
        resume_from=resume_from, **logprobs.wire_fields(params.logprobs))

  def _pd_prefill(self, rec, prompt, params, calls, context, downstream_id: str, di: int):
    """Route pdp, decoding on PD node ``di``: colocated when ``di`` also serves
    PD-P (one node, a "both" node) or no PD-P node is healthy (fallback);
    otherwise a PD-P node prefills and streams the state to ``di`` inside
    region B (the PrfaaS machinery with another prefill stub and address)."""
    colocated = self.pool.colocated(di)
    # Only a PD-P node that may hand ``di`` a whole state (node shapes: never
    # into a slice, never from one; a slice prefills its own: colocated).
    shipped = rec.prefix_node >= 0  # a prefix shipped for this request waits there
    prefer = rec.prefix_node if shipped else rec.pd_prefix_nodes
    ni = None if colocated else self.pool.pick(NodeKind.PDP, exclude={di}, prefer=prefer, to=di,
                                               soft=not shipped)
    if ni is None:
      if not colocated:
        self.counters["pdp_colocated_fallback"] += 1
        if "no_pdp_node" not in rec.route_reason:
          rec.route_reason += ";fallback:no_pdp_node:colocated"
      yield from self._local(rec, prompt, params, calls, context, downstream_id, di)
      return
    released = threading.Event()

    def release():
      # The PD-P node's part ends with its state transfer, not with the decode.
      if not released.is_set():
        released.set()
        self.pool.release(NodeKind.PDP, ni)
    try:
      yield from self._remote_once(rec, prompt, params, calls, context, downstream_id, di,
                                   None, pd_node=ni, on_prefill_done=release)
    except AttemptFailed as e:
      if lost_node(e.cause, e.code, rec.client_gone) == FailureCause.PREFILL:
        self.pool.mark_down(NodeKind.PDP, ni, e.message)
      raise
    finally:
      release()

  def _local(self, rec, prompt, params, calls, context, downstream_id: str, di: int,
             resume_from: str = ""):
    rec.pd_split = False
    rec.decode_server = self.pool.decode_targets[di].control
    rec.prefill_server = rec.decode_server
    att = rec.lifecycle.attempt
    att.decode_node = att.prefill_node = rec.decode_server
    att.pd_split = False
    rec.lifecycle.advance(RequestPhase.PREFILLING)
    try:
      dcall = self.pool.decode_stubs[di].Decode(
          self._decode_request(rec, prompt, params, False, downstream_id, resume_from),
          timeout=common.remaining_s(context), metadata=request_metadata(rec.request_id))
    except grpc.RpcError as e:
      raise self._downstream_error(rec, e, "decode server") from None
    calls["decode"] = dcall
    if rec.client_gone:
      dcall.cancel()
    yield from self._relay(rec, dcall, context)

  def _remote_once(self, rec, prompt, params, calls, context, downstream_id: str, di: int,
                   pi: int | None, *, pd_node: int | None = None, on_prefill_done=None):
    """PrfaaS server ``pi`` -> PD node ``di`` over the WAN; or, with
    ``pd_node``, PD-P node ``pd_node`` -> PD-D node ``di`` inside region B
    (the node's own StateTransfer port, no link accounting)."""
    target = self.pool.decode_targets[di]
    rec.decode_server = target.control
    rec.pd_split = pd_node is not None
    if pd_node is None:
      rec.prefill_server = self.pool.prefill_targets[pi]
      pstub, state_target = self.pool.prefill_stubs[pi], target.transfer
    else:
      rec.prefill_server = self.pool.decode_targets[pd_node].control
      pstub, state_target = self.pool.pdp_stubs[pd_node], target.intra_transfer
    att = rec.lifecycle.attempt
    att.decode_node, att.prefill_node, att.pd_split = (rec.decode_server, rec.prefill_server,
                                                      rec.pd_split)
    md = request_metadata(rec.request_id)
    dcall = self.pool.decode_stubs[di].Decode(
        self._decode_request(rec, prompt, params, True, downstream_id),
        timeout=common.remaining_s(context), metadata=md)
    calls["decode"] = dcall
    try:
      accepted = next(dcall)  # admission control before any prefill work
    except grpc.RpcError as e:
      err = self._downstream_error(rec, e, "decode server")
      if err.code != Code.UNAVAILABLE:
        err.cause = FailureCause.ADMISSION
      raise err from None
    except StopIteration:
      raise AttemptFailed(Code.INTERNAL, "decode server closed the stream before accepting")
    if not accepted.accepted:
      raise AttemptFailed(Code.INTERNAL, "decode server answered without accepting the request")
    rec.lifecycle.advance(RequestPhase.PREFILLING)
    preq = serving_pb2.PrefillRequest(
        request_id=downstream_id, model=self.model_name, prompt_ids=prompt,
        sampling=sampling_msg(params), seed=params.seed,
        decode_target=state_target, decode_slice=target.decode_slice,
        codec_json=self.codec_json,
        tenant=self.tenant, decode_held_tokens=accepted.held_tokens,
        **logprobs.wire_fields(params.logprobs))
    pcall = pstub.Prefill(preq, timeout=common.remaining_s(context), metadata=md)
    calls["prefill"] = pcall
    if rec.client_gone:
      pcall.cancel()
      dcall.cancel()
    follower = threading.Thread(target=self._follow_prefill,
                                args=(rec, pcall, dcall, self.pool.decode_stubs[di],
                                      downstream_id, rec.prefill_done, att),
                                kwargs={"wan": pd_node is None, "on_done": on_prefill_done},
                                name=f"prefill-{rec.request_id[:8]}", daemon=True)
    follower.start()
    try:
      yield from self._relay(rec, dcall, context)
    except AttemptFailed:
      pcall.cancel()  # never leave region A working for a failed attempt
      raise

  def _follow_prefill(self, rec: RequestRecord, pcall, dcall, dstub, downstream_id: str,
                      done: threading.Event, att, wan: bool = True, on_done=None) -> None:
    """Reads the Prefill stream: hands the first token over, records link stats
    (``wan``: the transfer crossed the inter-region link). ``on_done`` runs
    once the prefill stream ended."""
    md = request_metadata(rec.request_id)
    live, sent = (self.live if wan else None), {}
    if live is not None:
      live.transfer_started(downstream_id, rec.prompt_tokens)
    try:
      for ev in pcall:
        if ev.HasField("first_token"):
          ft = ev.first_token
          rec.prefill_s, rec.prefill_queue_s = ft.prefill_s, ft.queue_s
          rec.prefill_batch_size = ft.batch_size
          rec.cached_tokens = ft.cached_tokens
          rec.lifecycle.advance(RequestPhase.TRANSFERRING, att)
          # The prefill side's logit probe goes along: the decode server checks
          # the state it received against it before decoding (DATA_LOSS if not);
          # so does the first token's TokenLogprob (streamed by the decode side).
          dstub.Handoff(serving_pb2.HandoffRequest(
              request_id=downstream_id, first_token=ft.token_id,
              probe=ft.probe if ft.HasField("probe") else None,
              first_logprob=ft.logprob if ft.HasField("logprob") else None),
                        timeout=common.CONTROL_TIMEOUT_S, metadata=md)
          rec.lifecycle.state_awaited(att)
        elif ev.HasField("commit"):
          rec.commit_point = max(rec.commit_point, ev.commit.tokens)
        elif ev.HasField("done"):
          d = ev.done
          rec.transfer_s, rec.link_bytes, rec.state_bytes = (d.transfer_s, d.bytes_sent,
                                                             d.state_bytes)
          if not wan:
            rec.link_bytes = 0  # PD-P -> PD-D: region B's own network, not the link
          sent.update(nbytes=d.bytes_sent, duration_s=d.transfer_s)
    except grpc.RpcError as e:
      if (not rec.client_gone and done is rec.prefill_done and rec.phase not in (
          RequestPhase.FINISHED, RequestPhase.FAILED, RequestPhase.REROUTED)
          and not 0 < rec.prompt_tokens <= rec.commit_point):  # else the state is in B
        rec.prefill_error = (common.rpc_code(e), common.rpc_details(e))
        dcall.cancel()  # wakes the relay, which reports prefill_error
    finally:
      if live is not None:
        live.transfer_finished(downstream_id, prompt_tokens=rec.prompt_tokens, **sent)
      done.set()
      if on_done is not None:
        on_done()

  def _downstream_error(self, rec: RequestRecord, e: grpc.RpcError, who: str) -> AttemptFailed:
    code, details = common.rpc_code(e), common.rpc_details(e)
    if code == Code.UNAVAILABLE:
      # The decode server's connection broke (or it is shutting down).
      return AttemptFailed(code, f"{who} {rec.decode_server} is unavailable: {details}",
                           FailureCause.DECODE)
    if rec.prefill_error is not None and code == Code.CANCELLED:
      # The prefill side failed first; the follower cancelled the decode stream.
      pcode, pdetails = rec.prefill_error
      return AttemptFailed(pcode, f"prefill server {rec.prefill_server}: {pdetails}",
                           _prefill_side(pcode))
    if code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED):
      return AttemptFailed(code, f"{who}: {details}", FailureCause.REQUEST)
    # e.g. a state transfer that failed on the decode side (DATA_LOSS, CANCELLED,
    # DEADLINE_EXCEEDED): the prefill path's fault.
    return AttemptFailed(code, f"{who}: {details}", _prefill_side(code)
                         if rec.route == PRFAAS or rec.pd_split else FailureCause.DECODE)

  def _relay(self, rec: RequestRecord, dcall, context):
    """Forwards the decode stream to the client. After a restart, the tokens the
    client already has are checked against the regenerated ones, not resent."""
    decoder = self.tokenizer.decoder() if self.tokenizer is not None else None
    replay = list(rec.delivered)
    if decoder is not None and replay:
      decoder.feed(replay)
    slotted = False  # tokens before the slot: the first token, streamed early
    try:
      for ev in dcall:
        if ev.accepted:
          continue
        if not ev.token_ids and not ev.finished:  # the request got its slot
          slotted = True
          rec.lifecycle.state_restored()
          rec.decode_queue_s = ev.queue_s
          if rec.route == PDP and not rec.pd_split:  # colocated: prefill stats come here
            rec.prefill_s, rec.prefill_queue_s = ev.prefill_s, ev.prefill_queue_s
            rec.prefill_batch_size = ev.prefill_batch_size
            rec.cached_tokens = ev.prefill_cached_tokens
          if rec.resumed_from:
            self._resumed(rec, ev.resumed_tokens)
          continue
        tokens = list(ev.token_ids)
        lps = list(ev.logprobs)  # one per token when the request asked, else none
        while replay and tokens:
          if tokens[0] != replay[0]:
            raise AttemptFailed(Code.ABORTED, "the restarted request diverged from the tokens "
                                "already sent; retry the request")
          tokens.pop(0)
          replay.pop(0)
          if lps:
            lps.pop(0)
        if not tokens and not ev.finished:
          continue
        out = serving_pb2.GenerateResponse(request_id=rec.request_id)
        out.token_ids.extend(tokens)
        if lps:
          out.logprobs.extend(logprobs.with_text(lps, self.tokenizer))
        rec.delivered.extend(tokens)
        if not slotted:
          rec.early_tokens += len(tokens)
        rec.generated = len(rec.delivered)
        if decoder is not None and tokens:
          out.text = decoder.feed(tokens)
        if tokens and not rec.first_token_s:
          rec.first_token_s = rec.elapsed()
          out.summary.CopyFrom(rec.summary())
          if self.metrics is not None:
            self.metrics.observe_first_token(rec.route, rec.first_token_s)
        if ev.finished:
          rec.finish_reason = ev.finish_reason
          if rec.route == PRFAAS or rec.pd_split:
            rec.prefill_done.wait(timeout=10.0)
          rec.total_s = rec.elapsed()
          rec.lifecycle.advance(RequestPhase.FINISHED)
          self.counters["finished"] += 1
          out.finished = True
          out.finish_reason = ev.finish_reason
          out.summary.CopyFrom(rec.summary())
        yield out
        if ev.finished:
          return
    except grpc.RpcError as e:
      if rec.client_gone:
        return
      if (rec.route == PRFAAS or rec.pd_split) and rec.prefill_error is None:
        # The decode stream failed; if the prefill stream is failing too, let
        # it finish briefly, so the error names the real cause.
        rec.prefill_done.wait(timeout=2.0)
      raise self._downstream_error(rec, e, "decode server") from None
    if rec.client_gone:
      return
    raise AttemptFailed(Code.INTERNAL, "decode stream ended without finishing the request")

  def _resumed(self, rec: RequestRecord, resumed_tokens: int) -> None:
    """A resumed attempt got its slot: record the prompt tokens it did not recompute."""
    rec.resumed_tokens = int(resumed_tokens)
    rec.recomputed_tokens = rec.prompt_tokens - rec.resumed_tokens
    self.counters["resumed"] += int(resumed_tokens > 0)
    self.counters["resume_saved_tokens"] += rec.resumed_tokens
    self.counters["resume_recomputed_tokens"] += rec.recomputed_tokens
    if self.resume_metrics is not None:
      self.resume_metrics.observe(rec.route, rec.resumed_tokens, rec.recomputed_tokens)
