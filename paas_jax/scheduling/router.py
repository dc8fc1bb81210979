"""The PrfaaS routing policy (paper section 3.4.3) as a pure, side-effect-free object.

The same ``PrfaasRouter.decide`` runs inside the discrete-event simulator and (later) in
the live gRPC broker, so it takes plain frozen dataclasses and returns one; it never
reads clocks, sockets or global state.

Rule (all lengths in tokens):

1. Availability. No PrfaaS instance -> "pdp" (homogeneous PD). No PD-P instance ->
   "prfaas" (naive heterogeneous).
2. Bandwidth regime. The link is *abundant* iff
   ``link_utilization <= abundant_utilization`` and the backlog drains in at most
   ``abundant_backlog_s``; otherwise it is *scarce*.
3. Effective threshold t_eff (short-timescale adjustment of the long-timescale t). With
   the estimated waits (s) before a request would start prefill locally, and before an
   offloaded one would have its state at PD-D apart from its own compute and transfer,
     w_pdp = pdp_queue_depth * pdp_service_s / pdp_instances
     w_off = prfaas_queue_depth * prfaas_service_s / prfaas_instances + backlog_s
   (``*_service_s`` = mean prefill time of a request routed there, T_prfaas(l_long) and
   T_pdp(l_short) from the throughput model; backlog_s = link backlog / bandwidth):
   - *raise* to ``t * raise_factor`` if PD-P has headroom (``w_pdp < imbalance_s``) and
     either the link is congested (``link_utilization >= congested_utilization``,
     backlog_s ``>= congested_backlog_s`` or zero capacity) or the offload path is the
     longer wait by ``imbalance_s`` (``w_off - w_pdp >= imbalance_s``);
   - else *lower* to ``t / lower_factor`` if PrfaaS has headroom (``w_off < imbalance_s``),
     PD-P is the longer wait by ``imbalance_s`` and the link is idle
     (``link_utilization <= idle_utilization``): spill medium requests to PrfaaS;
   - else t_eff = t.
   Work only ever moves toward a side whose own wait is short. At the Lambda_max optimum
   PD-P runs near saturation, so a queue pushed onto it drains only at its small spare
   rate; and under sustained overload both queues grow and the long-timescale split must
   stay in force. In the simulator, reacting to one deep queue or to the link alone cut
   saturated throughput by 19% and inflated P90 TTFT 4.6x during a link dip
   (docs/scheduling.md).
4. Test. scarce: ``l_total - l_pd <= t_eff`` -> "pdp" (reusing the local prefix), else
   "prfaas" (reusing only what PrfaaS itself holds). abundant:
   ``l_prefix = max(l_pd, l_prfaas)``, same test with ``l_total - l_prefix``; the prefix
   comes from whichever cluster holds the longer one, so when that is the *other* cluster
   its KV/state crosses the link first (a cross-cluster cache transfer).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal

Route = Literal["pdp", "prfaas"]
PrefixSource = Literal["none", "pdp", "prfaas"]


@dataclasses.dataclass(frozen=True)
class RequestInfo:
  """One request as the router sees it (tokens).

  Attributes:
    l_total: input length.
    l_pd_cached: longest prefix reusable in the local PD cluster.
    l_prfaas_cached: longest prefix reusable in the PrfaaS cluster.
  """

  l_total: int
  l_pd_cached: int = 0
  l_prfaas_cached: int = 0

  def __post_init__(self):
    if self.l_total < 1:
      raise ValueError(f"l_total must be >= 1, got {self.l_total}")
    for name in ("l_pd_cached", "l_prfaas_cached"):
      v = getattr(self, name)
      if not 0 <= v <= self.l_total:
        raise ValueError(f"{name}={v} must lie in [0, l_total={self.l_total}]")


@dataclasses.dataclass(frozen=True)
class ClusterView:
  """A snapshot of the system state the broker can cheaply observe.

  Attributes:
    link_bandwidth_bps: current PrfaaS->PD link capacity, bits/s.
    link_utilization: delivered/capacity over a recent window, in [0, 1].
    prfaas_queue_depth: requests waiting (not running) for PrfaaS prefill.
    pdp_queue_depth: requests waiting for PD-P prefill.
    prfaas_instances: PrfaaS prefill instances currently serving.
    pdp_instances: PD-P prefill instances currently serving.
    link_backlog_bytes: bytes queued or in flight on the link.
  """

  link_bandwidth_bps: float
  link_utilization: float = 0.0
  prfaas_queue_depth: int = 0
  pdp_queue_depth: int = 0
  prfaas_instances: int = 1
  pdp_instances: int = 1
  link_backlog_bytes: float = 0.0

  def __post_init__(self):
    if not (self.link_bandwidth_bps >= 0 and math.isfinite(self.link_bandwidth_bps)):
      raise ValueError(f"link_bandwidth_bps must be finite and >= 0, got {self.link_bandwidth_bps}")
    if not 0.0 <= self.link_utilization <= 1.0:
      raise ValueError(f"link_utilization must lie in [0, 1], got {self.link_utilization}")
    if min(self.prfaas_queue_depth, self.pdp_queue_depth, self.prfaas_instances,
           self.pdp_instances) < 0 or self.link_backlog_bytes < 0:
      raise ValueError("queue depths, instance counts and backlog must be >= 0")

  @property
  def backlog_seconds(self) -> float:
    """Time to drain the link backlog at the current bandwidth (inf if the link is down)."""
    if self.link_backlog_bytes <= 0:
      return 0.0
    return math.inf if self.link_bandwidth_bps <= 0 else 8.0 * self.link_backlog_bytes / self.link_bandwidth_bps


class RouteRule(enum.StrEnum):
  """Which branch of the routing rule chose the route: a bounded, typed value
  (the decision's ``reason`` text adds the numbers). Values are the texts the
  reasons always started with."""

  # PrfaasRouter.decide (module docstring).
  NO_PRFAAS_CLUSTER = "no_prfaas_cluster"
  NO_PDP_CLUSTER = "no_pdp_cluster"
  SCARCE_SHORT = "scarce:short"      # scarce link, l - l_pd <= t_eff: local
  SCARCE_LONG = "scarce:long"
  ABUNDANT_SHORT = "abundant:short"  # abundant link, l - max prefix <= t_eff: local
  ABUNDANT_LONG = "abundant:long"
  # The serving broker's own cases (paas_jax.serving.routing, broker).
  STATIC_SHORT = "static:short"      # static rule l <= t
  STATIC_LONG = "static:long"
  FORCED_LOCAL = "forced:local"      # the client asked for a route
  FORCED_REMOTE = "forced:remote"
  NO_PREFILL_REGION = "no_prefill_region"
  # An abundant-link decision needed a prefix transfer the deployment cannot
  # do; re-taken with the scarce test.
  NO_CROSS_CLUSTER_PREFIX = "no_cross_cluster_prefix"


class ThresholdAdjustment(enum.StrEnum):
  """How t_eff was derived from t (rule 3 of the module docstring)."""

  BASE = "base"
  RAISED_CONGESTED_LINK = "raised:congested_link"
  RAISED_OFFLOAD_WAIT_LONGER = "raised:offload_wait_longer"
  LOWERED_PDP_WAIT_LONGER = "lowered:pdp_wait_longer_idle_link"


@dataclasses.dataclass(frozen=True)
class RoutingDecision:
  """Where to prefill and which cluster's prefix cache to reuse.

  Attributes:
    route: "pdp" (local PD prefill) or "prfaas" (remote prefill, KV crosses the link).
    prefix_source: cluster whose cached prefix is reused ("none" if nothing is reused).
    prefix_tokens: length of the reused prefix.
    effective_threshold: t_eff used for the test (tokens).
    bandwidth_mode: "scarce" or "abundant".
    rule: the branch of the rule that decided.
    adjustment: how t_eff came from t (None when no threshold test ran).
  """

  route: Route
  prefix_source: PrefixSource
  prefix_tokens: int
  effective_threshold: float
  bandwidth_mode: str
  rule: RouteRule
  adjustment: ThresholdAdjustment | None = None

  @property
  def reason(self) -> str:
    """Short machine-greppable explanation: ``rule[;adjustment]``."""
    return self.rule.value if self.adjustment is None else f"{self.rule};{self.adjustment}"

  @property
  def cross_cluster_prefix(self) -> bool:
    """True when the reused prefix lives in the other cluster and must cross the link."""
    return self.prefix_source not in ("none", self.route)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """Knobs of the routing rule; see the module docstring for their exact use."""

  threshold_tokens: float
  prfaas_service_s: float = 1.0
  pdp_service_s: float = 1.0
  abundant_utilization: float = 0.3
  abundant_backlog_s: float = 0.5
  congested_utilization: float = 0.8
  congested_backlog_s: float = 2.0
  idle_utilization: float = 0.3
  imbalance_s: float = 5.0
  raise_factor: float = 2.0
  lower_factor: float = 2.0

  def __post_init__(self):
    if not (self.threshold_tokens >= 0):
      raise ValueError(f"threshold_tokens must be >= 0 (inf allowed), got {self.threshold_tokens}")
    for name in ("abundant_utilization", "congested_utilization", "idle_utilization"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1]")
    if self.abundant_utilization >= self.congested_utilization:
      raise ValueError("abundant_utilization must be below congested_utilization")
    if self.raise_factor < 1.0 or self.lower_factor < 1.0:
      raise ValueError("raise_factor and lower_factor must be >= 1 (1 disables the adjustment)")
    if self.imbalance_s <= 0 or self.abundant_backlog_s < 0 or self.congested_backlog_s <= 0:
      raise ValueError("imbalance_s and congested_backlog_s must be > 0, abundant_backlog_s >= 0")
    if not (self.prfaas_service_s > 0 and self.pdp_service_s > 0):
      raise ValueError("prfaas_service_s and pdp_service_s must be > 0")


@dataclasses.dataclass(frozen=True)
class PrfaasRouter:
  """Pure routing policy. ``with_threshold`` returns a new router (Rebalancer updates)."""

  config: RouterConfig

  @property
  def threshold_tokens(self) -> float:
    return self.config.threshold_tokens

  def with_threshold(self, threshold_tokens: float, prfaas_service_s: float | None = None,
                     pdp_service_s: float | None = None) -> "PrfaasRouter":
    c = self.config
    return PrfaasRouter(dataclasses.replace(
        c, threshold_tokens=threshold_tokens,
        prfaas_service_s=c.prfaas_service_s if prfaas_service_s is None else prfaas_service_s,
        pdp_service_s=c.pdp_service_s if pdp_service_s is None else pdp_service_s))

  def bandwidth_mode(self, view: ClusterView) -> str:
    c = self.config
    abundant = (view.link_bandwidth_bps > 0 and view.link_utilization <= c.abundant_utilization
                and view.backlog_seconds <= c.abundant_backlog_s)
    return "abundant" if abundant else "scarce"

  def effective_threshold(self, view: ClusterView) -> tuple[float, ThresholdAdjustment]:
    c = self.config
    t = c.threshold_tokens
    congested = (view.link_bandwidth_bps <= 0 or view.link_utilization >= c.congested_utilization
                 or view.backlog_seconds >= c.congested_backlog_s)
    w_pd = view.pdp_queue_depth * c.pdp_service_s / max(view.pdp_instances, 1)
    # An offloaded request waits for PrfaaS prefill and then for the link to drain.
    w_off = view.prfaas_queue_depth * c.prfaas_service_s / max(view.prfaas_instances, 1)
    w_off += min(view.backlog_seconds, 1e9)
    # Work only moves toward a side whose own wait is short: PD-P runs near saturation at
    # the optimum, and a queue pushed onto it drains only at its small spare rate.
    if w_pd < c.imbalance_s:
      if congested:
        return t * c.raise_factor, ThresholdAdjustment.RAISED_CONGESTED_LINK
      if w_off - w_pd >= c.imbalance_s:
        return t * c.raise_factor, ThresholdAdjustment.RAISED_OFFLOAD_WAIT_LONGER
    if (w_off < c.imbalance_s and w_pd - w_off >= c.imbalance_s
        and view.link_utilization <= c.idle_utilization):
      return t / c.lower_factor, ThresholdAdjustment.LOWERED_PDP_WAIT_LONGER
    return t, ThresholdAdjustment.BASE

  def decide(self, request: RequestInfo, view: ClusterView) -> RoutingDecision:
    if view.prfaas_instances == 0 and view.pdp_instances == 0:
      raise ValueError("no prefill instance in either cluster")
    l_pd, l_rf = request.l_pd_cached, request.l_prfaas_cached
    mode = self.bandwidth_mode(view)
    if view.prfaas_instances == 0:
      return RoutingDecision("pdp", "pdp" if l_pd else "none", l_pd, math.inf, mode,
                             RouteRule.NO_PRFAAS_CLUSTER)
    if view.pdp_instances == 0:
      # Naive heterogeneous has no local prefill, so only PrfaaS's own cache can help.
      return RoutingDecision("prfaas", "prfaas" if l_rf else "none", l_rf, -math.inf, mode,
                             RouteRule.NO_PDP_CLUSTER)
    t_eff, adj = self.effective_threshold(view)
    if mode == "scarce":
      local = request.l_total - l_pd <= t_eff
      if local:
        return RoutingDecision("pdp", "pdp" if l_pd else "none", l_pd, t_eff, mode,
                               RouteRule.SCARCE_SHORT, adj)
      return RoutingDecision("prfaas", "prfaas" if l_rf else "none", l_rf, t_eff, mode,
                             RouteRule.SCARCE_LONG, adj)
    l_prefix = max(l_pd, l_rf)
    route: Route = "pdp" if request.l_total - l_prefix <= t_eff else "prfaas"
    # Ties go to the copy in the cluster that prefills: same reuse, no link
    # traffic (else an offloaded request would re-ship a prefix PrfaaS holds).
    own = l_pd if route == "pdp" else l_rf
    other: PrefixSource = "prfaas" if route == "pdp" else "pdp"
    source: PrefixSource = "none" if l_prefix == 0 else (route if own >= l_prefix else other)
    rule = RouteRule.ABUNDANT_SHORT if route == "pdp" else RouteRule.ABUNDANT_LONG
    return RoutingDecision(route, source, l_prefix, t_eff, mode, rule, adj)
