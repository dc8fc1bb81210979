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
  cached_prefix_tokens: int = 0

  @property
  def incremental_tokens(self) -> int:
    return self.prompt_tokens - self.cached_prefix_tokens


@dataclasses.dataclass(frozen=True)
class RouteDecision:
  route: Route
  reason: str
  threshold_tokens: float


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
    return RouteDecision(PDP, f"static:l={l}<=t={t:g}", t)


@dataclasses.dataclass
class AdaptiveRouterPolicy:
  """Adapter for ``paas_jax.scheduling.PrfaasRouter``.

  ``view`` returns the current ``ClusterView`` (link bandwidth/utilisation,
  queue depths...), e.g. built from the servers' GetStats.
  """

  router: object  # paas_jax.scheduling.PrfaasRouter
  view: Callable[[], object]

  def decide(self, request: RouteRequest) -> RouteDecision:
    from paas_jax.scheduling import RequestInfo  # pylint: disable=g-import-not-at-top
    d = self.router.decide(RequestInfo(l_total=request.prompt_tokens,
                                       l_pd_cached=request.cached_prefix_tokens),
                           self.view())
    t = d.effective_threshold
    return RouteDecision(d.route, f"adaptive:{d.reason}", t if math.isfinite(t) else -1.0)
