"""The broker: the front door of the two-region deployment.

For each ``Generate`` call it validates the request, asks the routing policy
where to prefill (PD-P in the PD region, or PrfaaS in the prefill region),
registers the request with a decode server, drives the prefill, relays the
token stream back to the client and tracks the request's lifecycle. When the
client goes away (cancel, deadline, dropped connection) every downstream call
is cancelled, which frees the decode slot and aborts the state transfer.

Remote route, in order:
  1. ``Decode.Decode(remote_prefill)`` -> accepted (admission control first, so
     a full pool answers RESOURCE_EXHAUSTED before any prefill work);
  2. ``Prefill.Prefill(decode_target)``: region A prefills and streams the state
     to the decode server's StateTransfer port (over the WAN);
  3. on ``FirstToken``: ``Decode.Handoff(first_token)``; the decode server
     inserts the request once state and token are both there;
     ``CommitPoint`` events tell how much of the prompt region B holds verified
     (a failed attempt resumes from it: ``resume.py``);
  4. tokens flow back on the Decode stream; ``TransferDone`` gives link bytes/time.

  python -m paas_jax.serving.broker --port=50050 --prefill=127.0.0.1:50051 \
      --decode=127.0.0.1:50052 --decode_transfer=127.0.0.1:50053 --threshold=128
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import threading
import time
import uuid
from typing import Sequence

import grpc
from absl import app, flags

from paas_jax.observability.logs import request_metadata
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.scheduling import FinishedRequest, rebalance_step
from paas_jax.security import cli as security_cli
from paas_jax.serving import common
from paas_jax.serving import pd_roles
from paas_jax.serving.resume import ResumeMetrics, ResumePolicy
from paas_jax.serving.node_pool import DecodeTarget, NodeKind, NodePool
from paas_jax.serving.request_lifecycle import (AttemptFailed, FailureCause, RequestLifecycle,
                                                RequestPhase, retry_decision)
from paas_jax.serving.validation import (InvalidRequestError, RequestParams,
                                         make_sampling, validate_request)
from paas_jax.serving.routing import (PDP, PRFAAS, AdaptiveRouterPolicy, RouteDecision,
                                      RouteRequest, RoutingPolicy, StaticThresholdPolicy)
from paas_jax.serving.tokenizer import ServedText, WrappedTokenizer, byte_text, checkpoint_text

log = logging.getLogger("paas_jax.serving.broker")

SERVICE = "paas_jax.serving.v1.Broker"
MAX_REQUEST_ID = 256
MAX_STOP_TOKENS = 1024
# Largest Generate request accepted on the public port (prompts of ~1M tokens).
MAX_REQUEST_BYTES = 16 << 20
# Tries per request: the first plus re-prefills / restarts after faults.
MAX_ATTEMPTS = 3
# Deadline of a cross-cluster prefix transfer (ExportPrefix); past it the
# request prefills without the prefix (at most half its own time left).
PREFIX_TRANSFER_TIMEOUT_S = 10.0
Code = grpc.StatusCode


@dataclasses.dataclass
class RequestRecord:
  """One request's lifecycle at the broker."""

  request_id: str
  prompt_tokens: int
  max_new_tokens: int
  # Id of the request at the regions (decode job, transfer): unique per
  # attempt even when a client reuses its own request ids.
  downstream_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
  created: float = dataclasses.field(default_factory=time.time)
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  route: str = ""
  route_reason: str = ""
  threshold: float = 0.0
  decode_server: str = ""
  prefill_server: str = ""
  first_token_s: float = 0.0
  prefill_s: float = 0.0
  prefill_queue_s: float = 0.0
  prefill_batch_size: int = 0
  # Routing inputs/outputs (adaptive router) and the prefix reused by the
  # server that prefilled (cached_tokens, as it reports it).
  l_pd_cached: int = 0
  l_prfaas_cached: int = 0
  prefix_source: str = ""
  bandwidth_mode: str = ""
  cached_tokens: int = 0
  # Cross-cluster prefix transfer before the prefill (abundant link, longer
  # prefix in the other region): direction ("prfaas->pdp" | "pdp->prfaas"),
  # what crossed, and why it did not ("CODE: message"; the request then
  # prefilled without it).
  prefix_transfer: str = ""
  prefix_transfer_tokens: int = 0
  prefix_transfer_bytes: int = 0
  prefix_transfer_s: float = 0.0
  prefix_transfer_error: str = ""
  prefix_node: int = -1  # the PD node a prefix was shipped to (its PD-P should prefill)
  transfer_s: float = 0.0
  decode_queue_s: float = 0.0
  link_bytes: int = 0
  state_bytes: int = 0
  generated: int = 0
  finish_reason: str = ""
  error: str = ""
  total_s: float = 0.0
  client_gone: bool = False
  # Route pdp prefilled on a PD-P node and decoded on another (PD-D) node: the
  # state moved like a PrfaaS one, inside region B.
  pd_split: bool = False
  reroutes: list = dataclasses.field(default_factory=list)
  # Tokens already sent to the client: a restarted request must reproduce
  # them (sampling is keyed by seed and position) and only sends what follows.
  delivered: list = dataclasses.field(default_factory=list)
  prefill_error: tuple | None = None
  prefill_done: threading.Event = dataclasses.field(default_factory=threading.Event)
  # Chunk-pipelined transfer (resume.py): the last commit point region A
  # reported; a resumed attempt's earlier id and the prompt tokens it did not
  # recompute (resumed_tokens) and recomputed.
  commit_point: int = 0
  resumed_from: str = ""
  resumed_tokens: int = 0
  recomputed_tokens: int = 0
  # The phase and attempts (request_lifecycle.py); default: a new request.
  lifecycle: RequestLifecycle | None = None

  def __post_init__(self):
    if self.lifecycle is None:
      self.lifecycle = RequestLifecycle(self.request_id)

  @property
  def phase(self) -> RequestPhase:
    return self.lifecycle.phase

  @property
  def attempts(self) -> int:
    return len(self.lifecycle.attempts)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def summary(self) -> serving_pb2.RequestSummary:
    return serving_pb2.RequestSummary(
        request_id=self.request_id, route=self.route, route_reason=self.route_reason,
        prompt_tokens=self.prompt_tokens, threshold_tokens=self.threshold,
        prefill_server=self.prefill_server, decode_server=self.decode_server,
        first_token_s=self.first_token_s, prefill_s=self.prefill_s,
        prefill_queue_s=self.prefill_queue_s, transfer_s=self.transfer_s,
        decode_queue_s=self.decode_queue_s, link_bytes=self.link_bytes,
        state_bytes=self.state_bytes, generated_tokens=self.generated,
        total_s=self.total_s, finish_reason=self.finish_reason,
        prefill_batch_size=self.prefill_batch_size, cached_tokens=self.cached_tokens,
        prefix_source=self.prefix_source, prefix_transfer_tokens=self.prefix_transfer_tokens,
        prefix_transfer_bytes=self.prefix_transfer_bytes,
        prefix_transfer_s=self.prefix_transfer_s, commit_point=self.commit_point,
        resumed_tokens=self.resumed_tokens, recomputed_tokens=self.recomputed_tokens)

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in ("t0", "prefill_done", "prefill_error", "delivered", "lifecycle")}
    d["phase"], d["attempts"] = self.phase.value, self.attempts
    d["prefill_error"] = None if self.prefill_error is None else (
        f"{self.prefill_error[0].name}: {self.prefill_error[1]}")
    return d


class BrokerServicer(serving_pb2_grpc.BrokerServicer):
  """Routes, drives and relays requests; see the module docstring.

  Faults: every region server is health-probed (``HealthMonitor``); a failed
  call marks its server down at once and a later successful probe brings it
  back (a restarted server rejoins by itself). A request whose remote
  prefill or state transfer fails before its first token reached the client
  is prefilled again elsewhere: another healthy prefill server if there is
  one, else locally in the PD region (PD-P). A request whose decode server
  dies is restarted from a prefill on another healthy decode server; the
  tokens already sent are regenerated identically (sampling is keyed by seed
  and position) and only the rest is sent. With no healthy decode server the
  request fails at once with UNAVAILABLE. At most ``max_attempts`` tries.
  """

  def __init__(self, model_config, policy: RoutingPolicy, *, prefill_targets: Sequence[str],
               decode_targets: Sequence[DecodeTarget], tokenizer=None,
               text: ServedText | None = None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               codec_json: str = "", recent_kept: int = 512, metrics=None,
               max_attempts: int = MAX_ATTEMPTS, health_interval_s: float = 1.0,
               roles: Sequence[str] | None = None):
    self.config = model_config
    self.policy = policy
    self.codec_json = codec_json
    # The served name, tokenizer, chat template and EOS ids (serving/tokenizer.py).
    # Default: a random-init config served by name (byte-level text if it fits).
    if text is None:
      text = (ServedText(model_config.name, tokenizer, "checkpoint") if tokenizer is not None
              else byte_text(model_config.name, model_config.vocab_size))
    self.text = text
    self.tokenizer = text.tokenizer
    self.metrics = metrics  # paas_jax.observability.ServingMetrics or None
    self.resume_policy = ResumePolicy(policy)
    self.resume_metrics = ResumeMetrics(metrics.registry) if metrics is not None else None
    self.max_attempts = max(1, max_attempts)
    self.counters = collections.Counter()
    # Picking, load, health, roles and drains of the nodes (node_pool.py).
    self.pool = NodePool(prefill_targets, decode_targets,
                         channel_credentials=channel_credentials,
                         health_interval_s=health_interval_s, roles=roles,
                         counters=self.counters)
    self.prefill_targets = self.pool.prefill_targets
    self.decode_targets = self.pool.decode_targets
    self._lock = threading.Lock()
    self._inflight: dict[str, RequestRecord] = {}
    self._recent: collections.deque[RequestRecord] = collections.deque(maxlen=recent_kept)
    self.started = time.time()
    if metrics is not None:
      metrics.track_queue("broker_inflight", lambda: len(self._inflight))
    # Live ClusterView, prefix probes and the rebalancer (enable_live_view).
    self.live = None
    self.rebalance: dict = {}
    self.rebalance_apply = False
    # Cross-cluster prefix transfers (ExportPrefix). Region A -> B needs only
    # the decode targets' transfer addresses: on from the start. B -> A once
    # enable_prefix_transfer is given region A's prefix (transfer) ports.
    self.prefill_transfer_targets: list[str] = []
    self.prefix_sources: frozenset = frozenset()
    self.prefix_transfer_timeout_s = PREFIX_TRANSFER_TIMEOUT_S
    self.enable_prefix_transfer()

  def enable_live_view(self, link_bandwidth_bps: float, *, poll_s: float = 0.2,
                       rebalance_every_s: float = 5.0, n_slots: int = 8,
                       apply_threshold: bool = False, probe_prefix: bool = True):
    """Starts the live ``ClusterView`` poller (``live_view.LiveClusterState``).

    An ``AdaptiveRouterPolicy`` whose ``view`` is None is fed from it; the
    broker then also probes both regions' prefix caches for each auto-routed
    request. Every ``rebalance_every_s`` a Rebalancer step re-solves t from the
    measured requests and the proposal goes to GetStats (``rebalance``);
    ``apply_threshold`` also puts the proposed t into the router.
    """
    from paas_jax.serving.live_view import LiveClusterState  # pylint: disable=g-import-not-at-top
    self.live = LiveClusterState(self.pool.prefill_stubs, self.pool.decode_stubs,
                                 link_bandwidth_bps=link_bandwidth_bps, poll_s=poll_s)
    self.live.probe_enabled = probe_prefix
    self.live.instance_counts = self.instance_counts
    if getattr(self.policy, "view", False) is None:
      self.policy.view = self.live.view
    self.rebalance_apply = apply_threshold
    self._n_slots = n_slots
    if rebalance_every_s > 0:
      self.live.every(rebalance_every_s, self._rebalance_step)
    self.live.start()
    return self.live

  def _rebalance_step(self) -> None:
    with self._lock:
      recs = [r for r in self._recent if r.phase == RequestPhase.FINISHED]
    n_p_now, moving = self.pool.split_now()
    # TPOT per request: decode time after the first token over the tokens that
    # followed it (decode step at the batch size it ran with).
    rows = [FinishedRequest(
        route=r.route, input_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
        output_tokens=max(r.generated, 1), prefill_s=r.prefill_s,
        link_bytes=r.link_bytes if r.route == PRFAAS else None,
        tpot_s=((r.total_s - r.first_token_s) / (r.generated - 1)
                if r.generated > 1 and r.total_s > r.first_token_s > 0 else None))
        for r in recs]
    router = getattr(self.policy, "router", None)
    t = router.threshold_tokens if router is not None else getattr(
        self.policy, "threshold_tokens", float("inf"))
    n_nodes = len(self.decode_targets)
    prop = rebalance_step(rows, threshold=t, n_slots=self._n_slots,
                          link_bandwidth_bps=self.live.link_bandwidth_bps,
                          n_pd_nodes=n_nodes, current_n_p=n_p_now,
                          n_prfaas=len(self.prefill_targets))
    prop["time"] = time.time()
    self.rebalance = prop
    if prop.get("status") != "ok":
      return
    apply = self.rebalance_apply and prop["apply"]
    log.info("rebalance: t %.0f -> %.0f, N_p %d -> %d (gain %.1f%%, apply=%s)",
             prop["current_threshold"], prop["proposed_threshold"], n_p_now,
             prop["proposed_split"]["n_p"], 100 * prop["relative_gain"], apply)
    if router is not None:
      # The measured service times are measurements, not a policy change: the
      # router's wait estimates get them every step; t only with apply.
      self.policy.router = router.with_threshold(
          prop["proposed_threshold"] if apply else router.threshold_tokens,
          prfaas_service_s=max(prop["prfaas_service_s"], 1e-3),
          pdp_service_s=max(prop["pdp_service_s"], 1e-3))
      self.counters["service_times_updated"] += 1
      if apply:
        self.counters["rebalance_applied"] += 1
    n_p = prop["proposed_split"]["n_p"]
    if apply and n_nodes > 1 and n_p != n_p_now and not moving:
      # Flip the fewest nodes, preferring those with the least work to drain.
      try:
        self.set_roles(pd_roles.plan_split(self.pool.roles(), n_p, self.pool.node_load()),
                       reason=f"rebalance: N_p {n_p_now}->{n_p}, "
                              f"gain {100 * prop['relative_gain']:.1f}%")
      except pd_roles.RoleError as e:
        log.warning("rebalance: cannot move PD nodes: %s", e)

  @property
  def health(self):
    """The nodes' ``HealthMonitor`` (the pool's)."""
    return self.pool.health

  @property
  def role_moves(self):
    return self.pool.role_moves

  def start_health(self) -> None:
    self.pool.start()

  def close(self) -> None:
    if self.live is not None:
      self.live.stop()
    self.pool.close()

  # -- PD node roles (the pool's; the operator's and the rebalancer's entry) ----------

  def set_roles(self, roles: Sequence[str], reason: str = "operator") -> list:
    """``NodePool.set_roles``: moves PD nodes to ``roles`` (drained first)."""
    return self.pool.set_roles(roles, reason=reason)

  def roles(self) -> list[str]:
    return self.pool.roles()

  def roles_info(self) -> list[dict]:
    return self.pool.roles_info()

  def instance_counts(self) -> tuple[int, int]:
    return self.pool.instance_counts()

  def _parse(self, request) -> tuple[list[int], RequestParams]:
    if request.model and request.model != self.text.name:
      raise InvalidRequestError(f"unknown model {request.model!r}; this broker serves "
                                f"{self.text.name!r}")
    if request.prompt_ids and request.prompt:
      raise InvalidRequestError("give prompt_ids or prompt, not both")
    if request.prompt:
      if self.tokenizer is None:
        raise InvalidRequestError(f"model {self.text.name!r} has no known tokenizer (its "
                                  "checkpoint has no tokenizer.json); send prompt_ids")
      prompt = self.tokenizer.encode(
          request.prompt, add_special_tokens=not request.prompt_has_special_tokens)
    else:
      prompt = [int(t) for t in request.prompt_ids]
    if len(request.request_id) > MAX_REQUEST_ID or not request.request_id.isprintable():
      raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID} printable "
                                "characters")
    if len(request.stop_tokens) > MAX_STOP_TOKENS:
      raise InvalidRequestError(f"at most {MAX_STOP_TOKENS} stop_tokens, got "
                                f"{len(request.stop_tokens)}")
    if request.route not in (serving_pb2.ROUTE_AUTO, serving_pb2.ROUTE_LOCAL,
                             serving_pb2.ROUTE_REMOTE):
      raise InvalidRequestError(f"unknown route {request.route}")
    params = RequestParams(
        sampling=make_sampling(request.sampling.temperature, request.sampling.top_k,
                               request.sampling.top_p),
        seed=int(request.seed), max_new_tokens=int(request.max_new_tokens),
        stop_tokens=tuple(dict.fromkeys(
            [int(t) for t in request.stop_tokens]
            + ([] if request.ignore_eos else list(self.text.eos_token_ids)))))
    validate_request(self.config, prompt, params)
    return prompt, params

  def _decide(self, request, prompt_len: int) -> RouteDecision:
    if request.route == serving_pb2.ROUTE_LOCAL:
      return RouteDecision(PDP, "forced:local", -1.0)
    if request.route == serving_pb2.ROUTE_REMOTE:
      if not self.prefill_targets:
        raise InvalidRequestError("route=REMOTE but this broker has no prefill region")
      return RouteDecision(PRFAAS, "forced:remote", -1.0)
    if not self.prefill_targets:
      return RouteDecision(PDP, "no_prefill_region", float("inf"))
    return self.policy.decide(RouteRequest(prompt_tokens=prompt_len))

  def _decide_live(self, request, prompt: list[int], rec: RequestRecord) -> RouteDecision:
    """``_decide`` with both regions' cached prefix lengths (live view only)."""
    if (self.live is None or not getattr(self.live, "probe_enabled", True)
        or request.route != serving_pb2.ROUTE_AUTO or not self.prefill_targets):
      return self._decide(request, len(prompt))
    rec.l_pd_cached, rec.l_prfaas_cached = self.live.probe_prefix(prompt)
    return self.policy.decide(RouteRequest(prompt_tokens=len(prompt),
                                           cached_prefix_tokens=rec.l_pd_cached,
                                           prfaas_cached_tokens=rec.l_prfaas_cached))

  @staticmethod
  def _sampling_msg(params: RequestParams) -> serving_pb2.SamplingParams:
    s = params.sampling
    return serving_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

  # -- Generate -------------------------------------------------------------------

  def Generate(self, request, context):
    try:
      prompt, params = self._parse(request)
    except InvalidRequestError as e:
      self.counters["invalid"] += 1
      context.abort(Code.INVALID_ARGUMENT, str(e))
    rid = request.request_id or uuid.uuid4().hex
    rec = RequestRecord(request_id=rid, prompt_tokens=len(prompt),
                        max_new_tokens=params.max_new_tokens)
    with self._lock:
      if rid in self._inflight:
        self.counters["invalid"] += 1
        context.abort(Code.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight")
      self._inflight[rid] = rec
    calls: dict[str, grpc.Future] = {}

    def on_rpc_done():
      # Runs when the Generate RPC ends for any reason; if the client went
      # away first, cancel every downstream call (decode slot, transfer).
      if rec.lifecycle.cancel():
        rec.client_gone = True
        for call in list(calls.values()):
          call.cancel()
    context.add_callback(on_rpc_done)
    self.counters["requests"] += 1
    outcome = "CANCELLED"
    try:
      try:
        decision = self._decide_live(request, prompt, rec)
      except InvalidRequestError as e:
        raise AttemptFailed(Code.INVALID_ARGUMENT, str(e)) from None
      rec.route, rec.route_reason = decision.route, decision.reason
      rec.threshold = decision.threshold_tokens
      rec.prefix_source = getattr(decision, "prefix_source", "none")
      rec.bandwidth_mode = getattr(decision, "bandwidth_mode", "")
      rec.lifecycle.advance(RequestPhase.ROUTED)
      self.counters[f"route_{decision.route}"] += 1
      if self.metrics is not None:
        self.metrics.observe_route(decision.route, decision.reason)
      yield from self._serve(rec, prompt, params, calls, context)
      if rec.phase == RequestPhase.FINISHED:
        outcome = "OK"
        log.info("request finished", extra={
            "request_id": rid, "route": rec.route, "tokens": len(rec.delivered),
            "attempts": rec.attempts, "ttft_s": round(rec.first_token_s, 4),
            "total_s": round(rec.elapsed(), 4), "prefill_server": rec.prefill_server,
            "decode_server": rec.decode_server})
    except AttemptFailed as e:
      rec.error = f"{e.code.name}: {e.message}"
      outcome = e.code.name
      if not rec.client_gone:
        rec.lifecycle.advance(RequestPhase.FAILED)
        self.counters["failed"] += 1
        log.warning("request %s failed: %s", rid, rec.error, extra={"request_id": rid})
        context.abort(e.code, e.message)
    except Exception as e:  # pylint: disable=broad-except
      # A bug, not a request error: report it as INTERNAL with a message
      # instead of a bare traceback.
      log.exception("request %s failed", rid, extra={"request_id": rid})
      rec.error = f"INTERNAL: {e!r}"
      if not rec.lifecycle.terminal:
        rec.lifecycle.advance(RequestPhase.FAILED)
      outcome = "INTERNAL"
      self.counters["failed"] += 1
      context.abort(Code.INTERNAL, f"broker error: {e!r}")
    finally:
      rec.total_s = rec.elapsed()
      with self._lock:
        self._inflight.pop(rid, None)
        self._recent.append(rec)
      if rec.client_gone:
        self.counters["cancelled"] += 1
      if self.metrics is not None:
        n = len(rec.delivered)
        tpot = ((rec.total_s - rec.first_token_s) / (n - 1)
                if outcome == "OK" and n > 1 else None)
        self.metrics.observe_request(rec.route or "none", outcome, tpot_s=tpot,
                                     total_s=rec.total_s)

  def _serve(self, rec: RequestRecord, prompt, params, calls, context):
    """Runs the request, re-prefilling / restarting it after faults (class docstring)."""
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
      di = self.pool.pick(NodeKind.DECODE, bad_decode,
                          prefer=resume.decode_index if resume else -1)
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
          self._ship_prefix(rec, prompt, context, route, di, pi, calls)
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
        if e.code == Code.UNAVAILABLE and not rec.client_gone:
          # Its connection broke: out of routing until a health probe (over the
          # same channel) succeeds again.
          if e.cause == FailureCause.DECODE:
            self.pool.mark_down(NodeKind.DECODE, di, e.message)
          elif e.cause == FailureCause.PREFILL and pi is not None:
            self.pool.mark_down(NodeKind.PREFILL, pi, e.message)
        if not self._retry_decision(rec, e, att, context).retry:
          raise
        attempt += 1
        calls.clear()
        if e.cause == FailureCause.DECODE:
          # The decode server went away: restart from a prefill on another one
          # (remote again if that was the route).
          bad_decode.add(di)
          self._reroute(rec, route, f"decode server down: {e.code.name}")
        else:
          if pi is not None:
            bad_prefill.add(pi)
          others = self.pool.healthy_prefill(exclude=bad_prefill)
          # DATA_LOSS: the state arrived damaged (a chunk that failed its
          # checksum for good, or a state that failed the logit probe): its
          # commit points are not trusted either; re-prefill locally from
          # scratch rather than over the same path again.
          damaged = e.code == Code.DATA_LOSS
          resume = None if damaged else self.resume_policy.decide(
              prompt_tokens=len(prompt), commit_point=rec.commit_point,
              earlier_id=downstream_id, decode_index=di,
              decode_healthy=self.pool.healthy(NodeKind.DECODE, di),
              other_prefill=bool(others), streamed=route == PRFAAS or rec.pd_split)
          if resume is not None and resume.resume:
            route = self._reroute(rec, PDP, f"prefill/transfer failed: {e.code.name}; "
                                  f"{resume.reason}", fallback=True)
          else:
            resume = None
            local = damaged or not others
            route = self._reroute(rec, PDP if local else PRFAAS,
                                  f"prefill/transfer failed: {e.code.name}", fallback=local)
      finally:
        self.pool.release(NodeKind.DECODE, di)
        if pi is not None:
          self.pool.release(NodeKind.PREFILL, pi)

  # -- cross-cluster prefix transfer ------------------------------------------------

  def enable_prefix_transfer(self, prefill_transfer_targets: Sequence[str] = (), *,
                             enabled: bool = True, timeout_s: float | None = None) -> None:
    """Which cross-cluster prefix transfers this broker does, and tells the policy.

    ``prefill_transfer_targets``: region A's prefix (StateTransfer) ports as
    the PD nodes reach them (e.g. the relay's B->A route), one per prefill
    target; without them only region A's prefixes are shipped (to PD-P).
    ``enabled=False`` ships none: an ``AdaptiveRouterPolicy`` then re-takes
    such decisions with the scarce rule (``no_cross_cluster_prefix``).
    """
    targets = list(prefill_transfer_targets)
    if targets and len(targets) != len(self.prefill_targets):
      raise ValueError(f"{len(targets)} prefill transfer targets for "
                       f"{len(self.prefill_targets)} prefill servers")
    self.prefill_transfer_targets = targets
    if timeout_s is not None:
      self.prefix_transfer_timeout_s = timeout_s
    sources = set()
    if enabled and self.prefill_targets:
      sources.add(PRFAAS)
      if targets:
        sources.add(PDP)
    self.prefix_sources = frozenset(sources)
    if hasattr(self.policy, "cross_cluster_prefix"):
      self.policy.cross_cluster_prefix = self.prefix_sources

  def _ship_prefix(self, rec: RequestRecord, prompt, context, route: str, di: int,
                   pi: int | None, calls: dict) -> None:
    """Ships the longer cached prefix to the region that will prefill, if the
    router chose one in the other region (abundant link). Never fails the
    request: on any error (or past its deadline) the request just prefills
    without it, and route_reason says so."""
    src = rec.prefix_source
    if src == route or src not in self.prefix_sources:
      return
    n = rec.l_prfaas_cached if src == PRFAAS else rec.l_pd_cached
    if n <= 0 or (route == PRFAAS and pi is None):
      return
    if src == PRFAAS:
      # Any prefill server may hold it (the probe took the max); try the healthy ones.
      exporters = [(self.pool.prefill_stubs[i], self.prefill_targets[i])
                   for i in range(len(self.prefill_targets))
                   if self.health.is_healthy(self.prefill_targets[i])]
      rec.prefix_node = self.pool.prefix_importer_node(di)
      target, link = self.decode_targets[rec.prefix_node].transfer, "A->B"
    else:
      order = [di] + [i for i in range(len(self.decode_targets)) if i != di]
      exporters = [(self.pool.decode_stubs[i], self.decode_targets[i].control) for i in order
                   if self.health.is_healthy(self.decode_targets[i].control)]
      target, link = self.prefill_transfer_targets[pi], "B->A"
    rec.prefix_transfer = f"{src}->{route}"
    rec.lifecycle.advance(RequestPhase.PREFIX_SHIPPING)
    budget = min(self.prefix_transfer_timeout_s, common.remaining_s(context) / 2)
    deadline = time.monotonic() + budget
    req = serving_pb2.ExportPrefixRequest(transfer_id=rec.downstream_id, model=self.config.name,
                                          prompt_ids=prompt, max_tokens=n, target=target)
    live, tid = self.live, f"prefix:{rec.downstream_id}"
    if live is not None:
      live.transfer_started(tid, n, direction=link)
    resp, error = None, "no healthy exporter"
    try:
      for stub, address in exporters:
        left = deadline - time.monotonic()
        if left <= 0 or rec.client_gone:
          error = error if rec.client_gone else f"DEADLINE_EXCEEDED: {budget:.1f} s budget spent"
          break
        # A future in ``calls``: a client that goes away cancels the export too.
        fut = stub.ExportPrefix.future(req, timeout=left,
                                       metadata=request_metadata(rec.request_id))
        calls["prefix"] = fut
        try:
          resp = fut.result()
          break
        except grpc.RpcError as e:
          error = f"{common.rpc_code(e).name}: {address}: {common.rpc_details(e)}"
          if common.rpc_code(e) != Code.NOT_FOUND:
            break  # the link or the importer failed: another exporter would too
    finally:
      calls.pop("prefix", None)
      if live is not None:
        live.transfer_finished(tid, prompt_tokens=resp.tokens if resp else 0,
                               nbytes=resp.bytes_sent if resp else 0,
                               duration_s=resp.transfer_s if resp else 0.0, direction=link)
      rec.lifecycle.advance(RequestPhase.ROUTED)
    if resp is None:
      rec.prefix_transfer_error = error
      rec.route_reason += f";prefix_transfer_failed({src}->{route}):{error.split(':', 1)[0]}"
      self.counters["prefix_transfer_failed"] += 1
      log.warning("request %s: prefix transfer %s failed, prefilling without it: %s",
                  rec.request_id, rec.prefix_transfer, error,
                  extra={"request_id": rec.request_id})
      return
    rec.prefix_transfer_tokens = resp.tokens
    rec.prefix_transfer_bytes = resp.bytes_sent
    rec.prefix_transfer_s = resp.transfer_s
    rec.route_reason += f";prefix_transfer({src}->{route}):{resp.tokens}"
    self.counters["prefix_transfers"] += 1
    self.counters["prefix_transfer_tokens"] += resp.tokens
    self.counters["prefix_transfer_bytes"] += resp.bytes_sent

  def _retry_decision(self, rec: RequestRecord, e: AttemptFailed, att, context):
    """``request_lifecycle.retry_decision`` with this request's facts."""
    return retry_decision(
        e.cause, e.code, att.number, max_attempts=self.max_attempts,
        client_gone=rec.client_gone, time_left_s=common.remaining_s(context),
        tokens_delivered=len(rec.delivered),
        other_decode_healthy=self.pool.other_decode_healthy(
            self.pool.decode_index(rec.decode_server)))

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
        request_id=downstream_id, model=self.config.name,
        prompt_ids=[] if remote else prompt, remote_prefill=remote, prompt_len=len(prompt),
        sampling=self._sampling_msg(params), seed=params.seed,
        max_new_tokens=params.max_new_tokens, stop_tokens=list(params.stop_tokens),
        resume_from=resume_from)

  def _pd_prefill(self, rec, prompt, params, calls, context, downstream_id: str, di: int):
    """Route pdp, decoding on PD node ``di``: colocated when ``di`` also serves
    PD-P (one node, a "both" node) or no PD-P node is healthy (fallback);
    otherwise a PD-P node prefills and streams the state to ``di`` inside
    region B (the PrfaaS machinery with another prefill stub and address)."""
    colocated = self.pool.colocated(di)
    ni = None if colocated else self.pool.pick(NodeKind.PDP, exclude={di},
                                               prefer=rec.prefix_node)
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
      if e.cause == FailureCause.PREFILL and e.code == Code.UNAVAILABLE and not rec.client_gone:
        self.pool.mark_down(NodeKind.PDP, ni, e.message)
      raise
    finally:
      release()

  def _local(self, rec, prompt, params, calls, context, downstream_id: str, di: int,
             resume_from: str = ""):
    rec.pd_split = False
    rec.decode_server = self.decode_targets[di].control
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
    target = self.decode_targets[di]
    rec.decode_server = target.control
    rec.pd_split = pd_node is not None
    if pd_node is None:
      rec.prefill_server = self.prefill_targets[pi]
      pstub, state_target = self.pool.prefill_stubs[pi], target.transfer
    else:
      rec.prefill_server = self.decode_targets[pd_node].control
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
        request_id=downstream_id, model=self.config.name, prompt_ids=prompt,
        sampling=self._sampling_msg(params), seed=params.seed,
        decode_target=state_target, codec_json=self.codec_json)
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
          # the state it received against it before decoding (DATA_LOSS if not).
          dstub.Handoff(serving_pb2.HandoffRequest(
              request_id=downstream_id, first_token=ft.token_id,
              probe=ft.probe if ft.HasField("probe") else None),
                        timeout=common.CONTROL_TIMEOUT_S, metadata=md)
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
                           FailureCause.PREFILL)
    if code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED):
      return AttemptFailed(code, f"{who}: {details}", FailureCause.REQUEST)
    # e.g. a state transfer that failed on the decode side (DATA_LOSS, CANCELLED,
    # DEADLINE_EXCEEDED): the prefill path's fault.
    return AttemptFailed(code, f"{who}: {details}", FailureCause.PREFILL
                         if rec.route == PRFAAS or rec.pd_split else FailureCause.DECODE)

  def _relay(self, rec: RequestRecord, dcall, context):
    """Forwards the decode stream to the client. After a restart, the tokens the
    client already has are checked against the regenerated ones, not resent."""
    decoder = self.tokenizer.decoder() if self.tokenizer is not None else None
    replay = list(rec.delivered)
    if decoder is not None and replay:
      decoder.feed(replay)
    try:
      for ev in dcall:
        if ev.accepted:
          continue
        if not ev.token_ids and not ev.finished:  # the request got its slot
          rec.decode_queue_s = ev.queue_s
          if rec.route == PDP and not rec.pd_split:  # colocated: prefill stats come here
            rec.prefill_s, rec.prefill_queue_s = ev.prefill_s, ev.prefill_queue_s
            rec.prefill_batch_size = ev.prefill_batch_size
            rec.cached_tokens = ev.prefill_cached_tokens
          if rec.resumed_from:
            self._resumed(rec, ev.resumed_tokens)
          continue
        tokens = list(ev.token_ids)
        while replay and tokens:
          if tokens[0] != replay[0]:
            raise AttemptFailed(Code.ABORTED, "the restarted request diverged from the tokens "
                                "already sent; retry the request")
          tokens.pop(0)
          replay.pop(0)
        if not tokens and not ev.finished:
          continue
        out = serving_pb2.GenerateResponse(request_id=rec.request_id)
        out.token_ids.extend(tokens)
        rec.delivered.extend(tokens)
        rec.generated = len(rec.delivered)
        if decoder is not None and tokens:
          out.text = decoder.feed(tokens)
        if tokens and not rec.first_token_s:
          rec.first_token_s = rec.elapsed()
          rec.lifecycle.advance(RequestPhase.DECODING)
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

  # -- stats ----------------------------------------------------------------------

  def GetStats(self, request, context):
    with self._lock:
      inflight = [r.to_dict() for r in self._inflight.values()]
      recent = [r.to_dict() for r in self._recent]
      phases = collections.Counter(r["phase"] for r in inflight)
    gauges = {k: float(v) for k, v in self.counters.items()}
    gauges.update({f"inflight_{p}": float(n) for p, n in phases.items()})
    gauges["inflight"] = float(len(inflight))
    gauges["uptime_s"] = time.time() - self.started
    return serving_pb2.StatsResponse(server="broker", gauges=gauges, json=json.dumps({
        "model": self.config.name,
        "served_model": self.text.describe(self.config.max_seq_len),
        "prefill": self.prefill_targets,
        "prefill_transfer": self.prefill_transfer_targets,
        "prefix_sources": sorted(self.prefix_sources),
        "decode": [dataclasses.asdict(t) for t in self.decode_targets],
        "inflight": inflight, "recent": recent, "router": self.router_info()}))

  def router_info(self) -> dict:
    """The policy in force, its threshold, the live view and the last rebalance."""
    router = getattr(self.policy, "router", None)
    t = (router.threshold_tokens if router is not None
         else getattr(self.policy, "threshold_tokens", None))
    return {"policy": type(self.policy).__name__, "threshold_tokens": t,
            "router_config": dataclasses.asdict(router.config) if router is not None else None,
            "live_view": self.live.snapshot() if self.live is not None else None,
            "rebalance": self.rebalance, "roles": self.roles_info(),
            "role_moves": list(self.role_moves)}

  # -- operator -------------------------------------------------------------------

  def SetRoles(self, request, context):
    """Moves PD nodes between roles (serving.proto: SetRolesRequest). Who may
    call it is the security layer's job (peers.BROKER_ADMIN_METHOD)."""
    reason = request.reason or "SetRoles"
    if len(reason) > 256 or not reason.isprintable():
      context.abort(Code.INVALID_ARGUMENT, "reason must be at most 256 printable characters")
    try:
      moves = self.set_roles(list(request.roles), reason=reason)
    except pd_roles.RoleError as e:
      context.abort(Code.FAILED_PRECONDITION if e.precondition else Code.INVALID_ARGUMENT,
                    str(e))
    return serving_pb2.SetRolesResponse(roles=self.roles(), moves_started=len(moves),
                                        json=json.dumps(self.roles_info()))


class BrokerServer:

  def __init__(self, servicer: BrokerServicer, control: common.RunningServer):
    self.servicer = servicer
    self.control = control

  @property
  def address(self) -> str:
    return self.control.address

  def stop(self) -> None:
    self.control.stop(0.5)
    self.servicer.close()


def start(model_config, policy: RoutingPolicy, *, prefill_targets: Sequence[str],
          decode_targets: Sequence[DecodeTarget], host: str = "127.0.0.1", port: int = 0,
          credentials: grpc.ServerCredentials | None = None, interceptors=(),
          channel_credentials: grpc.ChannelCredentials | None = None, tokenizer=None,
          text: ServedText | None = None, codec_json: str = "", max_workers: int = 256, security=None, metrics=None,
          max_attempts: int = MAX_ATTEMPTS, health_interval_s: float = 1.0,
          max_request_bytes: int = MAX_REQUEST_BYTES,
          roles: Sequence[str] | None = None) -> BrokerServer:
  """Starts the broker's public port.

  ``security`` (a ``paas_jax.security.ServiceSecurity`` of role broker): TLS
  on the public port with the bearer-token check, and mutual TLS with this
  broker's certificate to the regions; it overrides ``credentials`` and
  ``channel_credentials``. ``metrics`` records RPCs, routing, TTFT/TPOT and
  reroutes. Past ``max_workers`` concurrent calls, RESOURCE_EXHAUSTED.
  ``roles``: the PD nodes' starting roles (``pd_roles.default_roles``: one
  node "both", N > 1 split N // 2 PD-P).
  """
  from paas_jax.security.hooks import server_interceptors  # pylint: disable=g-import-not-at-top
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
  servicer = BrokerServicer(model_config, policy, prefill_targets=prefill_targets,
                            decode_targets=decode_targets, tokenizer=tokenizer, text=text,
                            channel_credentials=channel_credentials, codec_json=codec_json,
                            metrics=metrics, max_attempts=max_attempts,
                            health_interval_s=health_interval_s, roles=roles)
  control = common.start_server(
      f"{host}:{port}", lambda s: serving_pb2_grpc.add_BrokerServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=max_workers,
      interceptors=server_interceptors(security, metrics) + list(interceptors),
      max_message_bytes=max_request_bytes)
  servicer.start_health()
  control.set_serving([SERVICE])
  return BrokerServer(servicer, control)


FLAGS = flags.FLAGS


def make_policy(router: str, threshold: float, **router_config) -> RoutingPolicy:
  """``--router``: "static" (l > t offloads) or "adaptive" (``PrfaasRouter``,
  section 3.4.3, fed by the live view once ``enable_live_view`` runs)."""
  if router == "static":
    return StaticThresholdPolicy(threshold)
  if router != "adaptive":
    raise ValueError(f"unknown router {router!r} (static | adaptive)")
  from paas_jax.scheduling import PrfaasRouter, RouterConfig  # pylint: disable=g-import-not-at-top
  return AdaptiveRouterPolicy(PrfaasRouter(RouterConfig(threshold_tokens=threshold,
                                                        **router_config)), view=None)


def model_config_from_decode(target: str, credentials: grpc.ChannelCredentials | None = None):
  """The served model's config as a decode server reports it (for checkpoints)."""
  from paas_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  with common.make_channel(target, credentials) as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                 timeout=common.CONTROL_TIMEOUT_S)
  return ModelConfig.from_dict(json.loads(r.json)["config"])


def served_text(config, checkpoint: str | None, tokenizer_file: str | None,
                served_name: str = "", *, declared_config: bool) -> ServedText:
  """What the broker knows about text: the checkpoint's tokenizer, template, EOS
  ids and name; a random-init config served by name (``declared_config``) gets
  byte-level text; a model learned from the decode servers without a
  checkpoint gets no tokenizer (text prompts refused, never guessed)."""
  if checkpoint:
    from paas_jax.checkpoints import checkpoint_metadata  # pylint: disable=g-import-not-at-top
    from paas_jax.checkpoints.orbax_io import METADATA_ITEM  # pylint: disable=g-import-not-at-top
    meta = (checkpoint_metadata(checkpoint) if (pathlib.Path(checkpoint) / METADATA_ITEM).is_dir()
            else None)
    text = checkpoint_text(checkpoint, config_name=config.name, metadata=meta, name=served_name)
  elif declared_config:
    text = byte_text(served_name or config.name, config.vocab_size)
  else:
    text = ServedText(name=served_name or config.name)
  if tokenizer_file:
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    text = dataclasses.replace(text, tokenizer=WrappedTokenizer(
        Tokenizer.from_file(tokenizer_file)), kind="checkpoint")
  return text


def main(argv):
  del argv
  from paas_jax.models import load_config  # pylint: disable=g-import-not-at-top
  security_cli.setup_logging("broker", FLAGS.log_level)
  security = security_cli.security_from_flags("broker")
  metrics, metrics_port = security_cli.start_metrics("broker")
  channel_creds = security.channel_credentials()
  if len(FLAGS.decode) != len(FLAGS.decode_transfer):
    raise app.UsageError("--decode and --decode_transfer need the same number of entries")
  local = list(FLAGS.decode_local_transfer) or [""] * len(FLAGS.decode)
  if len(local) != len(FLAGS.decode):
    raise app.UsageError("--decode_local_transfer needs one entry per --decode")
  targets = [DecodeTarget(c, t, lt)
             for c, t, lt in zip(FLAGS.decode, FLAGS.decode_transfer, local)]
  try:
    roles = (pd_roles.validate_roles(FLAGS.pd_roles) if FLAGS.pd_roles
             else pd_roles.default_roles(len(targets), FLAGS.pd_prefill_nodes))
  except pd_roles.RoleError as e:
    raise app.UsageError(str(e)) from None
  threshold = float("inf") if FLAGS.threshold < 0 else FLAGS.threshold
  for target in list(FLAGS.prefill) + list(FLAGS.decode):
    common.wait_healthy(target, FLAGS.wait_s, credentials=channel_creds)
  config = (load_config(FLAGS.config) if FLAGS.config
            else model_config_from_decode(FLAGS.decode[0], channel_creds))
  text = served_text(config, FLAGS.checkpoint, FLAGS.tokenizer, FLAGS.served_model_name,
                     declared_config=bool(FLAGS.config))
  policy = make_policy(FLAGS.router, threshold)
  server = start(config, policy,
                 prefill_targets=FLAGS.prefill, decode_targets=targets, host=FLAGS.host,
                 port=FLAGS.port, codec_json=FLAGS.codec_json, text=text,
                 security=security, metrics=metrics, max_attempts=FLAGS.max_attempts,
                 max_request_bytes=FLAGS.max_request_bytes, roles=roles)
  if FLAGS.prefill_transfer and len(FLAGS.prefill_transfer) != len(FLAGS.prefill):
    raise app.UsageError("--prefill_transfer needs one entry per --prefill")
  server.servicer.enable_prefix_transfer(FLAGS.prefill_transfer,
                                         enabled=FLAGS.cross_cluster_prefix)
  if FLAGS.router == "adaptive" or FLAGS.live_view:
    server.servicer.enable_live_view(FLAGS.link_bandwidth_bps, poll_s=FLAGS.poll_ms / 1e3,
                                     rebalance_every_s=FLAGS.rebalance_every_s,
                                     n_slots=FLAGS.n_slots,
                                     apply_threshold=FLAGS.rebalance_apply)
  common.write_ready_file(FLAGS.ready_file, {"pid": os.getpid(), "port": server.control.port,
                                             "metrics_port": metrics_port})
  log.info("broker on %s: prefill %s, decode %s (roles %s), router %s, threshold %s",
           server.address, FLAGS.prefill, targets, list(roles), FLAGS.router, threshold)
  common.wait_for_termination(server.stop)


if __name__ == "__main__":
  flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config served (vocabulary, context); "
                      "empty: ask the first decode server (e.g. when serving a checkpoint).")
  flags.DEFINE_string("tokenizer", None, "tokenizer.json for --prompt text (default: the "
                      "--checkpoint's; byte-level for a --config with >= 256 ids).")
  flags.DEFINE_string("checkpoint", None, "The served checkpoint directory: its tokenizer, "
                      "chat template, EOS ids (generation_config.json) and model name.")
  flags.DEFINE_string("served_model_name", "", "Model name clients send (default: the "
                      "checkpoint's own name or the config name).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
  flags.DEFINE_integer("port", 0, "Port (0: pick a free one).")
  flags.DEFINE_list("prefill", [], "Prefill servers (PrfaaS region), host:port.")
  flags.DEFINE_list("decode", [], "Decode servers' control addresses, host:port.")
  flags.DEFINE_list("prefill_transfer", [],
                    "Each prefill server's prefix-import (StateTransfer) address as reached "
                    "from the PD region (e.g. the WAN relay's B->A route); empty: PD-P's "
                    "cached prefixes are never shipped to PrfaaS.")
  flags.DEFINE_bool("cross_cluster_prefix", True, "Ship a cached prefix to the other region "
                    "before prefilling when the adaptive router asks for it (abundant "
                    "link); off: such decisions fall back to the scarce rule.")
  flags.DEFINE_list("decode_transfer", [],
                    "Each decode server's StateTransfer address as reached from the prefill "
                    "region (e.g. the WAN relay).")
  flags.DEFINE_list("decode_local_transfer", [],
                    "Each decode server's StateTransfer address inside the PD region (PD-P "
                    "node -> PD-D node states; empty: --decode_transfer).")
  flags.DEFINE_list("pd_roles", [], "Starting role of each decode server: pdp, pdd or both "
                    "(empty: --pd_prefill_nodes).")
  flags.DEFINE_integer("pd_prefill_nodes", -1, "With N > 1 decode servers and no --pd_roles: "
                       "the last K are PD-P, the rest PD-D (-1: N // 2). One server: both.")
  flags.DEFINE_float("threshold", 128, "Selective offloading: prompts longer than this many "
                     "tokens are prefilled remotely (<0: never).")
  flags.DEFINE_string("codec_json", "", "CodecOptions JSON for the link (empty: server default).")
  flags.DEFINE_enum("router", "adaptive", ["static", "adaptive"],
                    "adaptive: PrfaasRouter (bandwidth regime, queue-aware t, prefix caches "
                    "of both regions) on a live ClusterView. static: l > threshold offloads "
                    "(the baseline; ClusterSpec's default, for deterministic tests).")
  flags.DEFINE_bool("live_view", False, "Poll the regions for the live ClusterView and probe "
                    "prefix caches even with --router=static.")
  flags.DEFINE_float("link_bandwidth_bps", 1e9, "PrfaaS->PD link capacity the router assumes.")
  flags.DEFINE_float("poll_ms", 200, "GetStats poll period of the live view.")
  flags.DEFINE_float("rebalance_every_s", 5.0, "Rebalancer period (0: off). Measured service "
                     "times always reach the router; t and PD roles only with --rebalance_apply.")
  flags.DEFINE_bool("rebalance_apply", False, "Put the rebalancer's t into the router and, with "
                    "several PD nodes, move nodes between PD-P and PD-D (drained first).")
  flags.DEFINE_integer("n_slots", 8, "Decode slots per decode server (rebalancer's BS_max).")
  flags.DEFINE_float("wait_s", 300, "How long to wait for the regions to become healthy.")
  flags.DEFINE_string("ready_file", None, "Write port/pid as JSON here once serving.")
  flags.DEFINE_integer("max_attempts", MAX_ATTEMPTS, "Tries per request (re-prefill / "
                       "restart after a server or link fault).")
  flags.DEFINE_integer("max_request_bytes", MAX_REQUEST_BYTES, "Largest request accepted.")
  flags.DEFINE_string("log_level", "INFO", "Logging level.")
  # TLS identity / --insecure, --api_tokens_file, --metrics_port, --log_format.
  security_cli.define_flags("broker")
  app.run(main)
