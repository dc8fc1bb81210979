"""The broker: the front door of the two-region deployment.

For each ``Generate`` call it validates the request, asks the routing policy
where to prefill (PD-P in the PD region, or PrfaaS in the prefill region),
registers the request with a decode server, drives the prefill, relays the
token stream back to the client and tracks the request's lifecycle. When the
client goes away (cancel, deadline, dropped connection) every downstream call
is cancelled, which frees the decode slot and aborts the state transfer.

A thin gRPC adapter over four parts, each in its own module:
  * ``request_lifecycle``: the request's phases, attempts, failure causes and
    retry policy (a typed state machine; ``RequestRecord`` for GetStats);
  * ``node_pool``: prefill servers and PD nodes (picking, load, health, roles,
    drains);
  * ``routing``: the ``RoutingPolicy`` interface (static or adaptive);
  * ``attempt_runner``: runs a routed request's attempts (remote route:
    Decode(remote_prefill) -> Prefill(decode_target) -> Handoff -> tokens),
    with ``prefix_shipping`` for cross-cluster prefix transfers first.

  python -m paas_jax.serving.broker --port=50050 --prefill=127.0.0.1:50051 \
      --decode=127.0.0.1:50052 --decode_transfer=127.0.0.1:50053 --threshold=128
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import runpy
import threading
import time
import uuid
from typing import Sequence

import grpc

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.scheduling import FinishedRequest, RouteRule, rebalance_step
from paas_jax.security.hooks import server_interceptors
from paas_jax.serving import common, control_plane, pd_roles
from paas_jax.serving.control_plane import model_config_from_decode
from paas_jax.serving.attempt_runner import AttemptRunner
from paas_jax.serving.live_view import LiveClusterState
from paas_jax.serving.node_pool import AffinityBalance, DecodeTarget, NodePool
from paas_jax.serving.prefix_shipping import PrefixShipper
from paas_jax.serving.request_lifecycle import AttemptFailed, RequestPhase
from paas_jax.serving.request_record import RequestRecord
from paas_jax.serving.resume import ResumePolicy
from paas_jax.serving.validation import (InvalidRequestError, RequestParams, requested_logprobs,
                                         make_sampling, validate_request)
from paas_jax.serving.routing import (PDP, PRFAAS, RouteDecision, RouteRequest, RoutingPolicy,
                                      make_policy)
from paas_jax.serving.tokenizer import ServedText, random_init_text, served_text

# Also public here (launchers and tests): make_policy, served_text, DecodeTarget.
__all__ = ["BrokerServer", "BrokerServicer", "DecodeTarget", "RequestRecord",
           "InvalidRequestError", "make_policy", "model_config_from_decode", "served_text",
           "start"]

log = logging.getLogger("paas_jax.serving.broker")

SERVICE = "paas_jax.serving.v1.Broker"
MAX_REQUEST_ID = 256
MAX_STOP_TOKENS = 1024
# Largest Generate request accepted on the public port (prompts of ~1M tokens).
MAX_REQUEST_BYTES = 16 << 20
# Tries per request: the first plus re-prefills / restarts after faults.
MAX_ATTEMPTS = 3
Code = grpc.StatusCode


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
               roles: Sequence[str] | None = None,
               affinity: AffinityBalance = AffinityBalance()):
    self.config = model_config
    self.policy = policy
    # The served name, tokenizer, chat template and EOS ids (serving/tokenizer.py).
    # Default: a random-init config served by name (Qwen's bundled vocabulary or
    # byte-level text, if either fits).
    if text is None:
      text = (ServedText(model_config.name, tokenizer, "checkpoint") if tokenizer is not None
              else random_init_text(model_config.name, model_config.vocab_size))
    self.text = text
    self.tokenizer = text.tokenizer
    self.metrics = metrics  # paas_jax.observability.ServingMetrics or None
    self.counters = collections.Counter()
    # Picking, load, health, roles and drains of the nodes (node_pool.py).
    self.pool = NodePool(prefill_targets, decode_targets,
                         channel_credentials=channel_credentials,
                         health_interval_s=health_interval_s, roles=roles,
                         counters=self.counters, affinity=affinity)
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
    self.shipper = PrefixShipper(self.pool, model_config.name, self.counters)
    self.enable_prefix_transfer()
    # Each request's attempts: nodes, prefill, transfer, relay, retries.
    self.runner = AttemptRunner(self.pool, self.shipper, model_name=model_config.name,
                                codec_json=codec_json, tokenizer=self.tokenizer,
                                max_attempts=max_attempts, counters=self.counters,
                                metrics=metrics, resume_policy=ResumePolicy(policy))

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
    self.live = LiveClusterState(self.pool.prefill_stubs, self.pool.decode_stubs,
                                 link_bandwidth_bps=link_bandwidth_bps, poll_s=poll_s)
    self.live.probe_enabled = probe_prefix
    self.live.instance_counts = self.instance_counts
    self.live.on_load_report = self.pool.observe_load
    self.policy.attach_view(self.live.view)
    self.runner.live = self.shipper.live = self.live
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
    t = self.policy.current_threshold()
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
    if self.policy.apply_rebalance(prop["proposed_threshold"],
                                   prfaas_service_s=max(prop["prfaas_service_s"], 1e-3),
                                   pdp_service_s=max(prop["pdp_service_s"], 1e-3),
                                   apply=apply):
      self.counters["service_times_updated"] += 1
      if apply:
        self.counters["rebalance_applied"] += 1
    n_p = prop["proposed_split"]["n_p"]
    if apply and n_nodes > 1 and n_p != n_p_now and not moving:
      # Flip the fewest nodes, preferring those with the least work to drain
      # (only nodes whose role may change: a decode slice stays "both").
      try:
        self.set_roles(pd_roles.plan_split_for(self.pool.roles(), self.pool.shapes, n_p,
                                               self.pool.node_load()),
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
            + ([] if request.ignore_eos else list(self.text.eos_token_ids)))),
        logprobs=requested_logprobs(request.logprobs, request.top_logprobs))
    validate_request(self.config, prompt, params)
    return prompt, params

  def _decide(self, request, prompt_len: int) -> RouteDecision:
    if request.route == serving_pb2.ROUTE_LOCAL:
      return RouteDecision(PDP, RouteRule.FORCED_LOCAL, "forced:local", -1.0)
    if request.route == serving_pb2.ROUTE_REMOTE:
      if not self.prefill_targets:
        raise InvalidRequestError("route=REMOTE but this broker has no prefill region")
      return RouteDecision(PRFAAS, RouteRule.FORCED_REMOTE, "forced:remote", -1.0)
    if not self.prefill_targets:
      return RouteDecision(PDP, RouteRule.NO_PREFILL_REGION, "no_prefill_region", float("inf"))
    return self.policy.decide(RouteRequest(prompt_tokens=prompt_len))

  def _decide_live(self, request, prompt: list[int], rec: RequestRecord) -> RouteDecision:
    """``_decide`` with both regions' cached prefix lengths (live view only)."""
    if (self.live is None or not self.live.probe_enabled
        or request.route != serving_pb2.ROUTE_AUTO or not self.prefill_targets):
      return self._decide(request, len(prompt))
    probe = self.live.probe_prefix_nodes(prompt)
    rec.l_pd_cached, rec.l_prfaas_cached = probe.pd_cached, probe.prfaas_cached
    rec.pd_prefix_nodes = probe.pd_nodes
    return self.policy.decide(RouteRequest(prompt_tokens=len(prompt),
                                           cached_prefix_tokens=rec.l_pd_cached,
                                           prfaas_cached_tokens=rec.l_prfaas_cached))

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
      rec.route_rule = decision.rule.value
      rec.threshold_adjustment = decision.adjustment.value if decision.adjustment else ""
      rec.threshold = decision.threshold_tokens
      rec.prefix_source = decision.prefix_source
      rec.bandwidth_mode = decision.bandwidth_mode
      rec.lifecycle.advance(RequestPhase.ROUTED)
      self.counters[f"route_{decision.route}"] += 1
      if self.metrics is not None:
        self.metrics.observe_route(decision.route, decision.reason)
      yield from self.runner.run(rec, prompt, params, calls, context)
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

  # -- cross-cluster prefix transfer ------------------------------------------------

  def enable_prefix_transfer(self, prefill_transfer_targets: Sequence[str] = (), *,
                             enabled: bool = True, timeout_s: float | None = None) -> None:
    """Which cross-cluster prefix transfers this broker does
    (``PrefixShipper.configure``), and tells the policy."""
    self.policy.set_prefix_sources(self.shipper.configure(
        prefill_transfer_targets, enabled=enabled, timeout_s=timeout_s))

  @property
  def prefill_transfer_targets(self) -> list[str]:
    return self.shipper.targets

  @property
  def prefix_sources(self) -> frozenset:
    return self.shipper.sources

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

  def GetModel(self, request, context):
    """The served model, typed (``ServedModel``; the OpenAI gateway reads it)."""
    return control_plane.served_model(self.config, max_model_len=self.config.max_seq_len,
                                      text=self.text)

  def router_info(self) -> dict:
    """The policy in force, its threshold, the live view and the last rebalance."""
    return {**self.policy.describe(),
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
          roles: Sequence[str] | None = None,
          affinity: AffinityBalance = AffinityBalance()) -> BrokerServer:
  """Starts the broker's public port.

  ``security`` (a ``paas_jax.security.ServiceSecurity`` of role broker): TLS
  on the public port with the bearer-token check, and mutual TLS with this
  broker's certificate to the regions; it overrides ``credentials`` and
  ``channel_credentials``. ``metrics`` records RPCs, routing, TTFT/TPOT and
  reroutes. Past ``max_workers`` concurrent calls, RESOURCE_EXHAUSTED.
  ``roles``: the PD nodes' starting roles (default ``pd_roles.default_roles_for``
  their shapes: one node "both", N > 1 single-process nodes split N // 2 PD-P,
  a decode slice always "both"). ``affinity``: when a prefix-cache
  preference yields to load (``node_pool.AffinityBalance``).
  """
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
  servicer = BrokerServicer(model_config, policy, prefill_targets=prefill_targets,
                            decode_targets=decode_targets, tokenizer=tokenizer, text=text,
                            channel_credentials=channel_credentials, codec_json=codec_json,
                            metrics=metrics, max_attempts=max_attempts,
                            health_interval_s=health_interval_s, roles=roles,
                            affinity=affinity)
  control = common.start_server(
      f"{host}:{port}", lambda s: serving_pb2_grpc.add_BrokerServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=max_workers,
      interceptors=server_interceptors(security, metrics) + list(interceptors),
      max_message_bytes=max_request_bytes)
  servicer.start_health()
  control.set_serving([SERVICE])
  return BrokerServer(servicer, control)


if __name__ == "__main__":
  # ``python -m paas_jax.serving.broker`` runs the launcher program (flags,
  # wiring: broker_main.py, which imports this module; run, not imported, so
  # there is no import cycle and importing the broker defines no flags).
  runpy.run_module("paas_jax.serving.broker_main", run_name="__main__", alter_sys=True)
