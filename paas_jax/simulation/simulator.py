"""Discrete-event simulator of a PrfaaS-PD deployment, driven by the live ``PrfaasRouter``.

Request life cycle (times in s, sizes in bytes, lengths in tokens):

1. Arrival: the broker looks up the usable cached prefix in each cluster
   (``PrefixCache.match``), builds ``RequestInfo`` and a ``ClusterView`` snapshot, and
   calls ``PrfaasRouter.decide`` -- the same object the gRPC broker will call.
2. Cross-cluster prefix (abundant bandwidth only): the prefix's KV + recurrent checkpoint
   (``k*l_prefix + c`` bytes) crosses the link toward the chosen cluster first, and is
   inserted into that cluster's cache.
3. Prefill: FIFO queue per cluster, one request per instance at a time, latency
   ``PrefillProfile.prefill_time(l_total, l_cached)``.
4. State hand-off: PD-P -> PD-D over uncontended RDMA; PrfaaS -> PD-D over the shared
   link, ``c + k*(l_total - l_pd)`` bytes (the PD cluster already holds the first l_pd
   tokens' KV in its cache pool).
5. Decode: join the least-loaded PD-D instance with a free slot (else wait FIFO). The
   first token was produced by prefill and is emitted when decode admits the request,
   so TTFT = admission - arrival. Decode is a fluid batch: all members advance one token
   per step, step time from ``DecodeProfile.step_time`` re-evaluated on every
   join/leave, and TPOT = (finish - admission) / (output_tokens - 1).

Local instances are PD nodes with a role (``paas_jax.serving.pd_roles``, the same pure rules
the live broker runs): PD-D nodes first (ids 0..n_decode-1), then PD-P nodes. With
``SimConfig.rebalance_split`` the long-timescale rebalancer may move nodes between PD-P and
PD-D: ``pd_roles.plan_split`` picks the fewest, least-loaded nodes, ``begin_moves`` starts
their drains and ``settle`` completes them. A node leaving PD-P takes no new prefill and
switches once its running prefill ends; a node leaving PD-D admits nothing and switches once
its decode batch is empty.

Simplifications: no chunked-prefill batching, no preemption, caches are per cluster (a
shared pool), offloaded requests populate only the PrfaaS cache (shipping intermediate
recurrent checkpoints would cost link bytes the paper's design does not spend).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.scheduling.router import ClusterView, PrfaasRouter, RequestInfo
# Pure role/move/drain rules shared with the live broker (stdlib only: no grpc, no jax).
from paas_jax.serving import pd_roles
from paas_jax.simulation.calibration import ServiceProfile
from paas_jax.simulation.events import EventLoop
from paas_jax.simulation.link import Link
from paas_jax.simulation.prefix_cache import CacheSpec, PrefixCache, TokenLayout
from paas_jax.simulation.workload import SimRequest


@dataclasses.dataclass(frozen=True)
class Deployment:
  """Instance counts. ``n_prfaas == 0``: homogeneous PD; ``n_pdp == 0``: naive heterogeneous."""

  n_prfaas: int
  n_pdp: int
  n_decode: int

  def __post_init__(self):
    if min(self.n_prfaas, self.n_pdp) < 0 or self.n_decode < 1:
      raise ValueError(f"need n_prfaas, n_pdp >= 0 and n_decode >= 1: {self}")
    if self.n_prfaas + self.n_pdp < 1:
      raise ValueError("need at least one prefill instance")


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated system.

  Attributes:
    service: hardware service times (profiles, link trace, RDMA).
    deployment: instance counts.
    router: the routing policy (shared with the live broker).
    cache: prefix-cache geometry/budget, applied to each cluster.
    utilization_window_s: trailing window of the link utilization the router sees.
    egress_bin_s: bin width of the egress time series.
    rebalancer: optional long-timescale re-solver of t (see ``rebalance_interval_s``).
    rebalance_interval_s: how often the rebalancer runs on the lengths seen since last time.
    rebalance_split: let the rebalancer also move PD nodes between PD-P and PD-D
      (N_p in 1..n_local-1, with drains). Off: the split stays as deployed (only t moves).
    rebalance_service_times: when a proposal applies, also push the plan's per-request
      prefill times (n / Theta) into the router's queue-wait estimates.
    max_events: safety valve against runaway simulations.
  """

  service: ServiceProfile
  deployment: Deployment
  router: PrfaasRouter
  cache: CacheSpec = CacheSpec()
  utilization_window_s: float = 5.0
  egress_bin_s: float = 1.0
  rebalancer: Rebalancer | None = None
  rebalance_interval_s: float = 300.0
  rebalance_split: bool = False
  rebalance_service_times: bool = False
  max_events: int = 10_000_000

  def __post_init__(self):
    if self.utilization_window_s <= 0 or self.egress_bin_s <= 0 or self.rebalance_interval_s <= 0:
      raise ValueError("window, bin and rebalance interval must be > 0")
    n_local = self.deployment.n_pdp + self.deployment.n_decode
    if self.rebalance_split and (self.rebalancer is None or self.rebalancer.n_local != n_local
                                 or n_local < 2):
      raise ValueError("rebalance_split needs a rebalancer whose n_local equals n_pdp + n_decode (>= 2)")


@dataclasses.dataclass(frozen=True)
class RequestRecord:
  """What happened to one request. Times are absolute simulation seconds."""

  request_id: int
  arrival_s: float
  input_tokens: int
  output_tokens: int
  route: str
  prefix_source: str
  cached_tokens: int
  reason: str
  prefill_start_s: float
  prefill_end_s: float
  decode_start_s: float
  finish_s: float
  egress_bytes: float  # bytes this request put on the PrfaaS -> PD link
  ingress_bytes: float  # bytes on the PD -> PrfaaS link (cross-cluster prefix)
  prefill_node: int = -1  # PD node that prefilled it (route "pdp"); -1 for PrfaaS
  decode_node: int = -1  # PD node that decoded it

  @property
  def ttft_s(self) -> float:
    return self.decode_start_s - self.arrival_s

  @property
  def tpot_s(self) -> float:
    return (self.finish_s - self.decode_start_s) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class RoleMoveRecord:
  """One PD node's move between roles; ``end_s``/``drain_s`` are nan if it never completed."""

  start_s: float
  node: int
  from_role: str
  to_role: str
  end_s: float
  drain_s: float


@dataclasses.dataclass(frozen=True)
class SimResult:
  records: tuple[RequestRecord, ...]
  egress_bin_s: float
  egress_bytes_per_bin: np.ndarray  # PrfaaS -> PD link
  link_bytes_requested: float
  link_bytes_delivered: float
  threshold_history: tuple[tuple[float, float], ...]  # (time s, threshold tokens)
  events: int
  unfinished: int
  role_moves: tuple[RoleMoveRecord, ...] = ()
  split_history: tuple[tuple[float, int, int], ...] = ()  # (time s, N_p, N_d) of settled roles


class _PrefillCluster:

  def __init__(self, name: str, profile: PrefillProfile, n: int, cache: PrefixCache):
    self.name, self.profile, self.n, self.cache = name, profile, n, cache
    self.queue: collections.deque = collections.deque()
    self.busy = 0


class _DecodeInstance:
  """Fluid decode batch: members advance together at 1/step_time tokens per second."""

  def __init__(self, idx: int, profile: DecodeProfile):
    self.idx, self.profile = idx, profile
    self.members: dict[int, list[float]] = {}  # rid -> [remaining tokens, context tokens]
    self.last = 0.0
    self.step = profile.step_time(0.0)
    self.version = 0

  def advance(self, now: float) -> None:
    dt = now - self.last
    if dt > 0 and self.members:
      tokens = dt / self.step
      for m in self.members.values():
        m[0] -= tokens
        m[1] += tokens
    self.last = max(self.last, now)

  def refresh_step(self) -> None:
    ctx = sum(m[1] for m in self.members.values())
    self.step = self.profile.step_time(ctx)


class Simulator:
  """Runs one ``SimConfig`` over a request trace. Deterministic: no randomness inside."""

  def __init__(self, config: SimConfig):
    self.cfg = config
    svc, dep = config.service, config.deployment
    self.loop = EventLoop()
    # Each direction of the inter-region link is its own fair-shared pipe.
    self.egress = Link(self.loop, svc.link, "prfaas->pd", config.egress_bin_s)
    self.ingress = Link(self.loop, svc.link, "pd->prfaas", config.egress_bin_s)
    # S_kv = c + k*l is a property of the model, so one (c, k) serves both clusters.
    kv = svc.prfaas_prefill
    self._kv_per_token, self._state_bytes = kv.kv_slope_bytes_per_token, kv.kv_fixed_bytes
    mk_cache = lambda: PrefixCache(config.cache, self._kv_per_token, self._state_bytes)
    self.clusters = {
        "prfaas": _PrefillCluster("prfaas", svc.prfaas_prefill, dep.n_prfaas, mk_cache()),
        "pdp": _PrefillCluster("pdp", svc.pdp_prefill, dep.n_pdp, mk_cache()),
    }
    # PD nodes: PD-D first (so decode tie-breaks by index are as before), then PD-P. Every
    # node has a decode batch object; only nodes serving decode admit into it.
    self.roles = (tuple(pd_roles.NodeRole(pd_roles.PDD_ROLE) for _ in range(dep.n_decode))
                  + tuple(pd_roles.NodeRole(pd_roles.PDP_ROLE) for _ in range(dep.n_pdp)))
    self.decoders = [_DecodeInstance(i, svc.decode) for i in range(len(self.roles))]
    self._pdp_running: dict[int, int] = {}  # PD-P node -> request it is prefilling
    self._moves: list[dict] = []
    self._refresh_roles()
    self._split_history = [(0.0, dep.n_pdp, dep.n_decode)]
    self.decode_queue: collections.deque = collections.deque()
    self.router = config.router
    self._state: dict[int, dict] = {}
    self._records: list[RequestRecord] = []
    self._recent_lengths: list[int] = []
    self._threshold_history = [(0.0, self.router.threshold_tokens)]

  # --- public -------------------------------------------------------------------------
  def run(self, requests: Sequence[SimRequest]) -> SimResult:
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
      raise ValueError("request ids must be unique")
    for r in requests:
      if r.output_tokens < 2:
        raise ValueError(f"request {r.request_id}: output_tokens must be >= 2")
      self.loop.schedule(r.arrival_s, self._on_arrival, r)
    if self.cfg.rebalancer is not None and requests:
      self.loop.schedule(self.cfg.rebalance_interval_s, self._on_rebalance)
    self.loop.run(max_events=self.cfg.max_events)
    _, egress_bins = self.egress.delivered_series()
    return SimResult(
        records=tuple(sorted(self._records, key=lambda r: r.request_id)),
        egress_bin_s=self.cfg.egress_bin_s, egress_bytes_per_bin=egress_bins,
        link_bytes_requested=self.egress.bytes_requested + self.ingress.bytes_requested,
        link_bytes_delivered=self.egress.bytes_delivered + self.ingress.bytes_delivered,
        threshold_history=tuple(self._threshold_history), events=self.loop.events_processed,
        unfinished=len(requests) - len(self._records),
        role_moves=tuple(RoleMoveRecord(m["start"], m["node"], m["from"], m["to"], m["end"],
                                        m["end"] - m["start"]) for m in self._moves),
        split_history=tuple(self._split_history))

  # --- PD node roles ----------------------------------------------------------------------
  def _refresh_roles(self) -> None:
    """Caches which nodes take new prefill/decode work now (``NodeRole.serving``)."""
    self._prefill_nodes = pd_roles.eligible(self.roles, pd_roles.PREFILL)
    self._decode_ok = [pd_roles.DECODE in n.serving for n in self.roles]
    self.clusters["pdp"].n = len(self._prefill_nodes)

  def _draining(self) -> bool:
    return any(n.draining for n in self.roles)

  def _settle(self) -> None:
    """Completes the moves whose dropped work (running prefill / decode batch) is done."""
    inflight = {}
    for i in range(len(self.roles)):
      inflight[(i, pd_roles.PREFILL)] = int(i in self._pdp_running)
      inflight[(i, pd_roles.DECODE)] = len(self.decoders[i].members)
    self.roles, done = pd_roles.settle(self.roles, inflight)
    if not done:
      return
    now = self.loop.now
    for i in done:
      for m in self._moves:
        if m["node"] == i and m["end"] != m["end"]:  # nan: the open move of this node
          m["end"] = now
    self._refresh_roles()
    n_p = sum(1 for n in self.roles if n.role == pd_roles.PDP_ROLE)
    self._split_history.append((now, n_p, len(self.roles) - n_p))
    self._try_start_prefill(self.clusters["pdp"])
    self._admit()

  def _move_to_split(self, n_p: int) -> None:
    """Starts the fewest, least-loaded moves that reach ``n_p`` PD-P nodes (live broker rule)."""
    load = {i: float(i in self._pdp_running) + len(self.decoders[i].members)
            for i in range(len(self.roles))}
    target = pd_roles.plan_split([n.final for n in self.roles], n_p, load)
    self.roles, moves = pd_roles.begin_moves(self.roles, target)
    for mv in moves:
      self._moves.append({"start": self.loop.now, "node": mv.node, "from": mv.from_role,
                          "to": mv.to_role, "end": float("nan")})
    self._refresh_roles()
    self._settle()  # idle nodes switch at once (drain 0 s)

  # --- arrival and routing -------------------------------------------------------------
  def _view(self, now: float) -> ClusterView:
    pf, pd = self.clusters["prfaas"], self.clusters["pdp"]
    return ClusterView(
        link_bandwidth_bps=self.egress.capacity_bps(now),
        link_utilization=self.egress.utilization(now, self.cfg.utilization_window_s),
        prfaas_queue_depth=len(pf.queue), pdp_queue_depth=len(pd.queue),
        prfaas_instances=pf.n, pdp_instances=pd.n,
        link_backlog_bytes=self.egress.backlog_bytes(now))

  def _on_arrival(self, req: SimRequest) -> None:
    now = self.loop.now
    layout = TokenLayout(req.request_id, req.input_tokens, req.prefix_id, req.shared_tokens)
    pf, pd = self.clusters["prfaas"], self.clusters["pdp"]
    l_pd = pd.cache.match(layout) if pd.n else 0
    l_rf = pf.cache.match(layout) if pf.n else 0
    decision = self.router.decide(RequestInfo(req.input_tokens, l_pd, l_rf), self._view(now))
    self._recent_lengths.append(req.input_tokens)
    st = dict(req=req, layout=layout, decision=decision, l_pd=l_pd, egress=0.0, ingress=0.0)
    self._state[req.request_id] = st
    dest = self.clusters[decision.route]
    if decision.cross_cluster_prefix:
      nbytes = self._kv_per_token * decision.prefix_tokens + self._state_bytes
      link = self.egress if decision.prefix_source == "prfaas" else self.ingress
      st["egress" if link is self.egress else "ingress"] += nbytes
      self.clusters[decision.prefix_source].cache.touch(layout, decision.prefix_tokens)
      link.start(nbytes, lambda t, rid=req.request_id: self._on_prefix_arrived(rid))
    else:
      if decision.prefix_tokens:
        dest.cache.touch(layout, decision.prefix_tokens)
      self._enqueue_prefill(req.request_id)

  def _on_prefix_arrived(self, rid: int) -> None:
    st = self._state[rid]
    self.clusters[st["decision"].route].cache.insert(st["layout"], st["decision"].prefix_tokens)
    self._enqueue_prefill(rid)

  # --- prefill ----------------------------------------------------------------------------
  def _enqueue_prefill(self, rid: int) -> None:
    cl = self.clusters[self._state[rid]["decision"].route]
    cl.queue.append(rid)
    self._try_start_prefill(cl)

  def _try_start_prefill(self, cl: _PrefillCluster) -> None:
    while cl.busy < cl.n and cl.queue:
      node = -1
      if cl.name == "pdp":
        # Lowest-index PD-P node that takes new prefills and is idle.
        node = next((i for i in self._prefill_nodes if i not in self._pdp_running), -1)
        if node < 0:
          break
      rid = cl.queue.popleft()
      st = self._state[rid]
      req, dec = st["req"], st["decision"]
      cl.busy += 1
      if node >= 0:
        self._pdp_running[node] = rid
      now = self.loop.now
      st["prefill_start"], st["prefill_node"] = now, node
      dur = float(cl.profile.prefill_time(req.input_tokens, dec.prefix_tokens))
      self.loop.schedule(now + dur, self._on_prefill_done, cl.name, rid)

  def _on_prefill_done(self, name: str, rid: int) -> None:
    cl = self.clusters[name]
    cl.busy -= 1
    now = self.loop.now
    st = self._state[rid]
    st["prefill_end"] = now
    if st["prefill_node"] >= 0:
      del self._pdp_running[st["prefill_node"]]
      if self.roles[st["prefill_node"]].draining:
        self._settle()
    req = st["req"]
    cl.cache.insert(st["layout"])
    overhead = self.cfg.service.overhead_s(name)
    if name == "pdp":
      nbytes = self._state_bytes + self._kv_per_token * req.input_tokens
      self.loop.schedule(now + 8.0 * nbytes / self.cfg.service.rdma_bps + overhead,
                         self._on_state_at_decode, rid)
    else:
      # The PD pool already holds the KV of the first l_pd tokens; ship the rest + state.
      nbytes = self._state_bytes + self._kv_per_token * (req.input_tokens - st["l_pd"])
      st["egress"] += nbytes
      self.egress.start(nbytes, lambda t, rid=rid: self._after_transfer(rid, overhead))
    self._try_start_prefill(cl)

  def _after_transfer(self, rid: int, overhead: float) -> None:
    if overhead > 0:
      self.loop.schedule(self.loop.now + overhead, self._on_state_at_decode, rid)
    else:
      self._on_state_at_decode(rid)

  # --- decode -----------------------------------------------------------------------------
  def _on_state_at_decode(self, rid: int) -> None:
    self.decode_queue.append(rid)
    self._admit()

  def _admit(self) -> None:
    now = self.loop.now
    bs = self.cfg.service.decode.max_batch_size
    touched = set()
    while self.decode_queue:
      free = [d for d in self.decoders if self._decode_ok[d.idx] and len(d.members) < bs]
      if not free:
        break
      inst = min(free, key=lambda d: (len(d.members), d.idx))
      rid = self.decode_queue.popleft()
      st = self._state[rid]
      req = st["req"]
      inst.advance(now)
      inst.members[rid] = [float(req.output_tokens - 1), float(req.input_tokens + 1)]
      st["decode_start"], st["decode_node"] = now, inst.idx
      touched.add(inst.idx)
    for idx in sorted(touched):
      self._reschedule_decode(self.decoders[idx])

  def _reschedule_decode(self, inst: _DecodeInstance) -> None:
    inst.version += 1
    inst.refresh_step()
    if inst.members:
      rem = min(m[0] for m in inst.members.values())
      self.loop.schedule(inst.last + max(rem, 0.0) * inst.step, self._on_decode_event, inst.idx,
                         inst.version)

  def _on_decode_event(self, idx: int, version: int) -> None:
    inst = self.decoders[idx]
    if version != inst.version:
      return
    now = self.loop.now
    inst.advance(now)
    # Time tolerance, not token tolerance: a residue shorter than the clock's resolution
    # would otherwise re-schedule onto the same timestamp forever.
    done = sorted(rid for rid, m in inst.members.items() if m[0] * inst.step <= 1e-9)
    for rid in done:
      del inst.members[rid]
      self._finish(rid, now)
    self._reschedule_decode(inst)
    if done and not inst.members and self.roles[idx].draining:
      self._settle()
    if done:
      self._admit()

  def _finish(self, rid: int, now: float) -> None:
    st = self._state.pop(rid)
    req, dec = st["req"], st["decision"]
    self._records.append(RequestRecord(
        request_id=rid, arrival_s=req.arrival_s, input_tokens=req.input_tokens,
        output_tokens=req.output_tokens, route=dec.route, prefix_source=dec.prefix_source,
        cached_tokens=dec.prefix_tokens, reason=dec.reason, prefill_start_s=st["prefill_start"],
        prefill_end_s=st["prefill_end"], decode_start_s=st["decode_start"], finish_s=now,
        egress_bytes=st["egress"], ingress_bytes=st["ingress"], prefill_node=st["prefill_node"],
        decode_node=st["decode_node"]))

  # --- long timescale ---------------------------------------------------------------------
  def _on_rebalance(self) -> None:
    rb = self.cfg.rebalancer
    # As in the live broker, nothing is re-planned while a move is still draining.
    if len(self._recent_lengths) >= rb.min_samples and not self._draining():
      if self.cfg.rebalance_split:
        # The split the nodes are heading to; N_p = 0 would leave PD-P nothing to run.
        current_n_p = pd_roles.split(self.roles)[0]
        choices = tuple(range(1, len(self.roles)))
      else:
        # Split pinned to the deployed one: only t is re-solved.
        current_n_p = self.cfg.deployment.n_pdp
        choices = (current_n_p,)
      # With moves, a new split must also beat re-tuning t alone by ``min_move_gain``.
      propose = rb.propose_split if self.cfg.rebalance_split else rb.propose
      prop = propose(self.router.threshold_tokens, current_n_p, self._recent_lengths,
                     n_p_choices=choices, egress_bandwidth_bps=self.egress.capacity_bps(self.loop.now))
      if prop.apply:
        plan = prop.plan
        service = {}
        if self.cfg.rebalance_service_times:
          service = dict(prfaas_service_s=_per_request_s(plan.theta_prfaas_compute, plan.n_prfaas),
                         pdp_service_s=_per_request_s(plan.theta_pdp, plan.n_p))
        self.router = self.router.with_threshold(plan.threshold_tokens, **service)
        self._threshold_history.append((self.loop.now, plan.threshold_tokens))
        if plan.n_p != current_n_p:
          self._move_to_split(plan.n_p)
      self._recent_lengths = []
    if self._state or self.loop.pending:
      self.loop.schedule(self.loop.now + self.cfg.rebalance_interval_s, self._on_rebalance)


def _per_request_s(theta: float, n: int) -> float | None:
  """n / Theta = the class's prefill time per request; None (keep the old one) if no traffic."""
  return n / theta if n > 0 and theta > 0 and np.isfinite(theta) else None


def simulate(config: SimConfig, requests: Sequence[SimRequest]) -> SimResult:
  """Convenience wrapper: a fresh ``Simulator`` per run (they are single-use)."""
  return Simulator(config).run(requests)
