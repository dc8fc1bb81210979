"""Where the broker prefills a request: the routing-policy seam.

The broker only sees the ``RoutingPolicy`` interface: ``decide(RouteRequest)
-> RouteDecision`` plus the hooks the broker drives (a live ``ClusterView``,
which prefixes it can ship across, the rebalancer's measurements); a policy
without a use for a hook inherits the no-op.
This issue ships the static selective-offloading rule (paper section 3.4):
a request whose incremental prefill length ``l = prompt - cached prefix``
exceeds the threshold ``t`` is prefilled remotely by PrfaaS, otherwise locally
by PD-P. ``AdaptiveRouterPolicy`` plugs the scheduling package's
``PrfaasRouter`` (bandwidth- and queue-aware thresholds) into the same seam.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Callable, Literal

from paas_jax.scheduling import (ClusterView, PrfaasRouter, RequestInfo, RouteRule, RouterConfig,
                                 ThresholdAdjustment)

Route = Literal["pdp", "prfaas"]
PDP: Route = "pdp"
PRFAAS: Route = "prfaas"


@dataclasses.dataclass(frozen=True)
class RouteRequest:
  """What the policy knows of a request (tokens)."""

  prompt_tokens: int
  cached_prefix_tokens: int = 0   # l_pd: reusable in the PD region
  prfaas_cached_tokens: int = 0   # l_prfaas: reusable in the PrfaaS region

  @property
  def incremental_tokens(self) -> int:
    return self.prompt_tokens - self.cached_prefix_tokens


@dataclasses.dataclass(frozen=True)
class RouteDecision:
  """The broker's routing decision. ``rule`` / ``adjustment`` are the typed
  branch and threshold adjustment (bounded); ``reason`` the audit text with the
  numbers (GetStats ``route_reason``, grows with fallbacks at the broker)."""

  route: Route
  rule: RouteRule
  reason: str
  threshold_tokens: float
  prefix_source: str = "none"     # cluster whose cached prefix is reused
  prefix_tokens: int = 0
  bandwidth_mode: str = ""
  adjustment: ThresholdAdjustment | None = None


class RoutingPolicy(abc.ABC):
  """Where requests prefill. Subclasses implement ``decide`` and
  ``current_threshold``; the hooks default to "not used by this policy"."""

  @abc.abstractmethod
  def decide(self, request: RouteRequest) -> RouteDecision:
    """The route of one request."""

  @abc.abstractmethod
  def current_threshold(self) -> float:
    """The offload threshold t in force (tokens; inf: never offload)."""

  def attach_view(self, view: Callable[[], object]) -> None:
    """A live ``ClusterView`` source (the broker's live view) became available."""

  def set_prefix_sources(self, sources: frozenset) -> None:
    """Regions whose cached prefixes the broker can ship across ("prfaas", "pdp")."""

  def apply_rebalance(self, proposed_threshold: float, *, prfaas_service_s: float,
                      pdp_service_s: float, apply: bool) -> bool:
    """The rebalancer's measured service times (and, with ``apply``, its t).
    Returns whether the policy took them."""
    del proposed_threshold, prfaas_service_s, pdp_service_s, apply
    return False

  def describe(self) -> dict:
    """For GetStats: the policy, its threshold and its configuration."""
    return {"policy": type(self).__name__, "threshold_tokens": self.current_threshold(),
            "router_config": None}


@dataclasses.dataclass(frozen=True)
class StaticThresholdPolicy(RoutingPolicy):
  """l > t goes to PrfaaS, the rest to PD-P; ``t = inf`` keeps everything local."""

  threshold_tokens: float

  def __post_init__(self):
    if not self.threshold_tokens >= 0:
      raise ValueError(f"threshold_tokens must be >= 0, got {self.threshold_tokens}")

  def current_threshold(self) -> float:
    return self.threshold_tokens

  def decide(self, request: RouteRequest) -> RouteDecision:
    l, t = request.incremental_tokens, self.threshold_tokens
    if l > t:
      return RouteDecision(PRFAAS, RouteRule.STATIC_LONG, f"static:l={l}>t={t:g}", t)
    return RouteDecision(PDP, RouteRule.STATIC_SHORT, f"static:l={l}<=t={t:g}", t,
                         "pdp" if request.cached_prefix_tokens else "none",
                         request.cached_prefix_tokens)


@dataclasses.dataclass
class AdaptiveRouterPolicy(RoutingPolicy):
  """Adapter for ``paas_jax.scheduling.PrfaasRouter``.

  ``view`` returns the current ``ClusterView`` (link bandwidth/utilisation,
  queue depths...), e.g. built from the servers' GetStats.
  """

  router: object  # paas_jax.scheduling.PrfaasRouter
  view: Callable[[], object] | None = None
  # Which regions' cached prefixes the deployment can ship to the other region
  # before prefilling (the broker's ExportPrefix transfers): True = both,
  # False = none, or a collection of prefix sources ("prfaas": A -> B,
  # "pdp": B -> A). The broker sets it to what it can do. A decision that
  # needs a transfer it cannot do (abundant link, longer prefix in the other
  # region) is re-taken with the scarce test: local iff l_total - l_pd <=
  # t_eff, and each region reuses only its own cache.
  cross_cluster_prefix: bool | frozenset = False

  def current_threshold(self) -> float:
    return self.router.threshold_tokens

  def attach_view(self, view: Callable[[], object]) -> None:
    if self.view is None:  # an explicitly given view stays
      self.view = view

  def set_prefix_sources(self, sources: frozenset) -> None:
    self.cross_cluster_prefix = sources

  def apply_rebalance(self, proposed_threshold: float, *, prfaas_service_s: float,
                      pdp_service_s: float, apply: bool) -> bool:
    # The measured service times are measurements, not a policy change: the
    # router's wait estimates get them every step; t only with ``apply``.
    self.router = self.router.with_threshold(
        proposed_threshold if apply else self.router.threshold_tokens,
        prfaas_service_s=prfaas_service_s, pdp_service_s=pdp_service_s)
    return True

  def describe(self) -> dict:
    return {"policy": type(self).__name__, "threshold_tokens": self.current_threshold(),
            "router_config": dataclasses.asdict(self.router.config)}

  def ships(self, prefix_source: str) -> bool:
    """Whether a prefix cached in ``prefix_source`` can be shipped across."""
    x = self.cross_cluster_prefix
    return bool(x) if isinstance(x, bool) else prefix_source in x

  def decide(self, request: RouteRequest) -> RouteDecision:
    # No live view yet: an idle, unloaded 1 Gbps link (the static rule plus prefixes).
    view = self.view() if self.view is not None else ClusterView(link_bandwidth_bps=1e9)
    d = self.router.decide(RequestInfo(l_total=request.prompt_tokens,
                                       l_pd_cached=request.cached_prefix_tokens,
                                       l_prfaas_cached=request.prfaas_cached_tokens), view)
    t = d.effective_threshold
    reason = f"adaptive:{d.reason}"
    if d.cross_cluster_prefix and not self.ships(d.prefix_source):
      l_pd, l_rf = request.cached_prefix_tokens, request.prfaas_cached_tokens
      local = request.prompt_tokens - l_pd <= t
      route, src, n = (PDP, "pdp", l_pd) if local else (PRFAAS, "prfaas", l_rf)
      reason += f";no_cross_cluster_prefix({d.prefix_source}->{d.route}):{route}"
      return RouteDecision(route, RouteRule.NO_CROSS_CLUSTER_PREFIX, reason,
                           t if math.isfinite(t) else -1.0, src if n else "none", n,
                           d.bandwidth_mode, d.adjustment)
    return RouteDecision(d.route, d.rule, reason, t if math.isfinite(t) else -1.0,
                         d.prefix_source, d.prefix_tokens, d.bandwidth_mode, d.adjustment)


def make_policy(router: str, threshold: float, **router_config) -> RoutingPolicy:
  """``--router``: "static" (l > t offloads) or "adaptive" (``PrfaasRouter``,
  section 3.4.3, fed by the live view once ``enable_live_view`` runs)."""
  if router == "static":
    return StaticThresholdPolicy(threshold)
  if router != "adaptive":
    raise ValueError(f"unknown router {router!r} (static | adaptive)")
  return AdaptiveRouterPolicy(PrfaasRouter(RouterConfig(threshold_tokens=threshold,
                                                        **router_config)), view=None)
