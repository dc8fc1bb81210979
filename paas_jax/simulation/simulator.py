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
  max_events: int = 10_000_000

  def __post_init__(self):
    if self.utilization_window_s <= 0 or self.egress_bin_s <= 0 or self.rebalance_interval_s <= 0:
      raise ValueError("window, bin and rebalance interval must be > 0")


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

  @property
  def ttft_s(self) -> float:
    return self.decode_start_s - self.arrival_s

  @property
  def tpot_s(self) -> float:
    return (self.finish_s - self.decode_start_s) / (self.output_tokens - 1)


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
    self.decoders = [_DecodeInstance(i, svc.decode) for i in range(dep.n_decode)]
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
        unfinished=len(requests) - len(self._records))

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
      rid = cl.queue.popleft()
      st = self._state[rid]
      req, dec = st["req"], st["decision"]
      cl.busy += 1
      now = self.loop.now
      st["prefill_start"] = now
      dur = float(cl.profile.prefill_time(req.input_tokens, dec.prefix_tokens))
      self.loop.schedule(now + dur, self._on_prefill_done, cl.name, rid)

  def _on_prefill_done(self, name: str, rid: int) -> None:
    cl = self.clusters[name]
    cl.busy -= 1
    now = self.loop.now
    st = self._state[rid]
    st["prefill_end"] = now
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
      free = [d for d in self.decoders if len(d.members) < bs]
      if not free:
        break
      inst = min(free, key=lambda d: (len(d.members), d.idx))
      rid = self.decode_queue.popleft()
      st = self._state[rid]
      req = st["req"]
      inst.advance(now)
      inst.members[rid] = [float(req.output_tokens - 1), float(req.input_tokens + 1)]
      st["decode_start"] = now
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
        egress_bytes=st["egress"], ingress_bytes=st["ingress"]))

  # --- long timescale ---------------------------------------------------------------------
  def _on_rebalance(self) -> None:
    rb = self.cfg.rebalancer
    if len(self._recent_lengths) >= rb.min_samples:
      # Only t is re-solved live: flipping instances between PD-P and PD-D needs drains the
      # simulator does not model, so the split is pinned to the deployed one.
      prop = rb.propose(self.router.threshold_tokens, self.cfg.deployment.n_pdp, self._recent_lengths,
                        n_p_choices=(self.cfg.deployment.n_pdp,),
                        egress_bandwidth_bps=self.egress.capacity_bps(self.loop.now))
      if prop.apply:
        self.router = self.router.with_threshold(prop.plan.threshold_tokens)
        self._threshold_history.append((self.loop.now, prop.plan.threshold_tokens))
      self._recent_lengths = []
    if self._state or self.loop.pending:
      self.loop.schedule(self.loop.now + self.cfg.rebalance_interval_s, self._on_rebalance)


def simulate(config: SimConfig, requests: Sequence[SimRequest]) -> SimResult:
  """Convenience wrapper: a fresh ``Simulator`` per run (they are single-use)."""
  return Simulator(config).run(requests)
