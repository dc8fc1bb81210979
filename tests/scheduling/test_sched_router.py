"""Routing rules of section 3.4.3 on crafted cases."""

import math

import pytest

from paas_jax.scheduling.router import (ClusterView, PrfaasRouter, RequestInfo, RouteRule,
                                        RouterConfig, RoutingDecision, ThresholdAdjustment)

T = 10_000
ROUTER = PrfaasRouter(RouterConfig(threshold_tokens=T, prfaas_service_s=2.0, pdp_service_s=2.0))
SCARCE = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.5, prfaas_instances=4, pdp_instances=3)
ABUNDANT = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.1, prfaas_instances=4, pdp_instances=3)


def test_scarce_uses_only_local_prefix_for_the_test():
  d = ROUTER.decide(RequestInfo(15_000, l_pd_cached=6_000), SCARCE)
  assert (d.route, d.prefix_source, d.prefix_tokens, d.bandwidth_mode) == ("pdp", "pdp", 6_000, "scarce")
  assert not d.cross_cluster_prefix
  # 15000 - 4000 > t: offload, and PrfaaS reuses only its own cache.
  d = ROUTER.decide(RequestInfo(15_000, l_pd_cached=4_000, l_prfaas_cached=12_000), SCARCE)
  assert (d.route, d.prefix_source, d.prefix_tokens) == ("prfaas", "prfaas", 12_000)


def test_boundary_is_inclusive():
  assert ROUTER.decide(RequestInfo(T), SCARCE).route == "pdp"
  assert ROUTER.decide(RequestInfo(T + 1), SCARCE).route == "prfaas"


def test_abundant_uses_remote_cache_with_cross_cluster_transfer():
  req = RequestInfo(15_000, l_pd_cached=0, l_prfaas_cached=8_000)
  # Scarce: the PrfaaS prefix does not count for the local test -> offload.
  assert ROUTER.decide(req, SCARCE).route == "prfaas"
  # Abundant: l_prefix = 8000, 7000 <= t -> stay local, pull the prefix across the link.
  d = ROUTER.decide(req, ABUNDANT)
  assert (d.route, d.prefix_source, d.prefix_tokens, d.bandwidth_mode) == ("pdp", "prfaas", 8_000, "abundant")
  assert d.cross_cluster_prefix
  # Long remainder in abundant mode: offload, pushing the longer local prefix to PrfaaS.
  d = ROUTER.decide(RequestInfo(40_000, l_pd_cached=9_000, l_prfaas_cached=2_000), ABUNDANT)
  assert (d.route, d.prefix_source) == ("prfaas", "pdp") and d.cross_cluster_prefix


def test_abundant_tie_prefers_local_copy():
  d = ROUTER.decide(RequestInfo(12_000, l_pd_cached=5_000, l_prfaas_cached=5_000), ABUNDANT)
  assert (d.route, d.prefix_source) == ("pdp", "pdp")
  # Offloaded: PrfaaS's own copy, not a second one shipped from PD-P.
  d = ROUTER.decide(RequestInfo(40_000, l_pd_cached=5_000, l_prfaas_cached=5_000), ABUNDANT)
  assert (d.route, d.prefix_source) == ("prfaas", "prfaas") and not d.cross_cluster_prefix


def test_congested_link_raises_threshold():
  req = RequestInfo(15_000)
  assert ROUTER.decide(req, SCARCE).route == "prfaas"
  hot = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.9, prfaas_instances=4, pdp_instances=3)
  d = ROUTER.decide(req, hot)
  assert d.route == "pdp" and d.effective_threshold == 2 * T and "congested_link" in d.reason
  backlog = ClusterView(link_bandwidth_bps=8e9, link_utilization=0.5, link_backlog_bytes=3e9,
                        prfaas_instances=4, pdp_instances=3)  # 3 s to drain
  assert ROUTER.decide(req, backlog).route == "pdp"
  down = ClusterView(link_bandwidth_bps=0.0, prfaas_instances=4, pdp_instances=3)
  assert ROUTER.decide(req, down).route == "pdp"


def test_congestion_does_not_flood_a_busy_pdp():
  # PD-P already has a 9*2/3 = 6 s >= 5 s wait: congestion must not push more work onto it.
  busy = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.9, pdp_queue_depth=9,
                     prfaas_instances=4, pdp_instances=3)
  d = ROUTER.decide(RequestInfo(15_000), busy)
  assert d.route == "prfaas" and d.effective_threshold == T


def test_deep_prfaas_queue_raises_and_deep_pdp_queue_lowers():
  # PrfaaS wait 12*2/4 = 6 s vs PD-P 0 s: imbalance >= 5 s -> raise.
  deep_rf = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.5, prfaas_queue_depth=12,
                        prfaas_instances=4, pdp_instances=3)
  d = ROUTER.decide(RequestInfo(15_000), deep_rf)
  assert d.route == "pdp" and "offload_wait_longer" in d.reason
  # PD-P wait 9*2/3 = 6 s vs 0 s, link idle -> lower to t/2 = 5000: an 8000-token request leaves.
  deep_pd = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.1, pdp_queue_depth=9,
                        prfaas_instances=4, pdp_instances=3)
  d = ROUTER.decide(RequestInfo(8_000), deep_pd)
  assert d.route == "prfaas" and d.effective_threshold == T / 2
  # Same queue but a busy link: no spilling.
  busy_link = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.5, pdp_queue_depth=9,
                          prfaas_instances=4, pdp_instances=3)
  assert ROUTER.decide(RequestInfo(8_000), busy_link).route == "pdp"


def test_overload_on_both_sides_keeps_base_threshold():
  both = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.5, prfaas_queue_depth=40,
                     pdp_queue_depth=30, prfaas_instances=4, pdp_instances=3)
  d = ROUTER.decide(RequestInfo(15_000), both)
  assert d.effective_threshold == T and d.route == "prfaas"


def test_missing_clusters_force_the_route():
  homo = ClusterView(link_bandwidth_bps=0.0, prfaas_instances=0, pdp_instances=9)
  assert ROUTER.decide(RequestInfo(100_000), homo).route == "pdp"
  naive = ClusterView(link_bandwidth_bps=100e9, prfaas_instances=4, pdp_instances=0)
  d = ROUTER.decide(RequestInfo(100, l_pd_cached=50, l_prfaas_cached=20), naive)
  assert (d.route, d.prefix_source, d.prefix_tokens) == ("prfaas", "prfaas", 20)
  with pytest.raises(ValueError):
    ROUTER.decide(RequestInfo(100), ClusterView(link_bandwidth_bps=1.0, prfaas_instances=0, pdp_instances=0))


def test_router_is_pure_and_retunable():
  req, view = RequestInfo(15_000, 1_000, 2_000), SCARCE
  a, b = ROUTER.decide(req, view), ROUTER.decide(req, view)
  assert a == b and isinstance(a, RoutingDecision)
  r2 = ROUTER.with_threshold(20_000, prfaas_service_s=3.0)
  assert r2.threshold_tokens == 20_000 and r2.config.prfaas_service_s == 3.0
  assert ROUTER.threshold_tokens == T  # original untouched
  assert r2.decide(RequestInfo(15_000), SCARCE).route == "pdp"
  assert PrfaasRouter(RouterConfig(threshold_tokens=math.inf)).decide(RequestInfo(10**6), SCARCE).route == "pdp"


@pytest.mark.parametrize("ctor", [
    lambda: RequestInfo(0),
    lambda: RequestInfo(10, l_pd_cached=11),
    lambda: ClusterView(link_bandwidth_bps=1.0, link_utilization=1.5),
    lambda: ClusterView(link_bandwidth_bps=-1.0),
    lambda: RouterConfig(threshold_tokens=-1),
    lambda: RouterConfig(threshold_tokens=1, abundant_utilization=0.9, congested_utilization=0.8),
    lambda: RouterConfig(threshold_tokens=1, raise_factor=0.5),
])
def test_bad_inputs_raise(ctor):
  with pytest.raises(ValueError):
    ctor()


def test_every_branch_names_its_typed_rule_and_the_reason_text_is_unchanged():
  hot = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.9, prfaas_instances=4,
                    pdp_instances=3)
  deep_rf = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.5, prfaas_queue_depth=12,
                        prfaas_instances=4, pdp_instances=3)
  deep_pd = ClusterView(link_bandwidth_bps=100e9, link_utilization=0.1, pdp_queue_depth=9,
                        prfaas_instances=4, pdp_instances=3)
  cases = [
      (RequestInfo(5_000), SCARCE, RouteRule.SCARCE_SHORT, ThresholdAdjustment.BASE,
       "scarce:short;base"),
      (RequestInfo(15_000), SCARCE, RouteRule.SCARCE_LONG, ThresholdAdjustment.BASE,
       "scarce:long;base"),
      (RequestInfo(5_000), ABUNDANT, RouteRule.ABUNDANT_SHORT, ThresholdAdjustment.BASE,
       "abundant:short;base"),
      (RequestInfo(15_000), ABUNDANT, RouteRule.ABUNDANT_LONG, ThresholdAdjustment.BASE,
       "abundant:long;base"),
      (RequestInfo(15_000), hot, RouteRule.SCARCE_SHORT, ThresholdAdjustment.RAISED_CONGESTED_LINK,
       "scarce:short;raised:congested_link"),
      (RequestInfo(15_000), deep_rf, RouteRule.SCARCE_SHORT,
       ThresholdAdjustment.RAISED_OFFLOAD_WAIT_LONGER, "scarce:short;raised:offload_wait_longer"),
      (RequestInfo(8_000), deep_pd, RouteRule.ABUNDANT_LONG,
       ThresholdAdjustment.LOWERED_PDP_WAIT_LONGER, "abundant:long;lowered:pdp_wait_longer_idle_link"),
      (RequestInfo(100), ClusterView(link_bandwidth_bps=0.0, prfaas_instances=0, pdp_instances=9),
       RouteRule.NO_PRFAAS_CLUSTER, None, "no_prfaas_cluster"),
      (RequestInfo(100), ClusterView(link_bandwidth_bps=1e9, prfaas_instances=4, pdp_instances=0),
       RouteRule.NO_PDP_CLUSTER, None, "no_pdp_cluster"),
  ]
  for request, view, rule, adjustment, reason in cases:
    d = ROUTER.decide(request, view)
    assert (d.rule, d.adjustment, d.reason) == (rule, adjustment, reason), (request, view, d)
    assert isinstance(d.rule, RouteRule)
  # The rules are a closed set: a misspelt one does not construct.
  with pytest.raises(ValueError):
    RouteRule("scarce:shrot")
