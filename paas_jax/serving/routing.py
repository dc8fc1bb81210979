"""Where the broker prefills a request: the routing-policy seam.

The broker only sees ``RoutingPolicy.decide(RouteRequest) -> RouteDecision``.
This issue ships the static selective-offloading rule (paper section 3.4):
a request whose incremental prefill length ``l = prompt - cached prefix``
exceeds the threshold ``t`` is prefilled remotely by PrfaaS, otherwise locally
by PD-P. ``AdaptiveRouterPolicy`` plugs the scheduling package's
``PrfaasRouter`` (bandwidth- and queue-aware thresholds) into the same seam.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, Protocol

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
  route: Route
  reason: str
  threshold_tokens: float
  prefix_source: str = "none"     # cluster whose cached prefix is reused
  prefix_tokens: int = 0
  bandwidth_mode: str = ""


class RoutingPolicy(Protocol):

  def decide(self, request: RouteRequest) -> RouteDecision: ...


@dataclasses.dataclass(frozen=True)
class StaticThresholdPolicy:
  """l > t goes to PrfaaS, the rest to PD-P; ``t = inf`` keeps everything local."""

  threshold_tokens: float

  def __post_init__(self):
    if not self.threshold_tokens >= 0:
      raise ValueError(f"threshold_tokens must be >= 0, got {self.threshold_tokens}")

  def decide(self, request: RouteRequest) -> RouteDecision:
    l, t = request.incremental_tokens, self.threshold_tokens
    if l > t:
      return RouteDecision(PRFAAS, f"static:l={l}>t={t:g}", t)
    return RouteDecision(PDP, f"static:l={l}<=t={t:g}", t,
                         "pdp" if request.cached_prefix_tokens else "none",
                         request.cached_prefix_tokens)


@dataclasses.dataclass
class AdaptiveRouterPolicy:
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

  def ships(self, prefix_source: str) -> bool:
    """Whether a prefix cached in ``prefix_source`` can be shipped across."""
    x = self.cross_cluster_prefix
    return bool(x) if isinstance(x, bool) else prefix_source in x

  def decide(self, request: RouteRequest) -> RouteDecision:
    from paas_jax.scheduling import ClusterView, RequestInfo  # pylint: disable=g-import-not-at-top
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
      return RouteDecision(route, reason, t if math.isfinite(t) else -1.0,
                           src if n else "none", n, d.bandwidth_mode)
    return RouteDecision(d.route, reason, t if math.isfinite(t) else -1.0,
                         d.prefix_source, d.prefix_tokens, d.bandwidth_mode)
