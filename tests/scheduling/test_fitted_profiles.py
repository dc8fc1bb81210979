"""Prefill profiles fitted to measured requests stay physical: never falling with
length, never negative.

The rows below are a real `make demo` run's 16 requests (2026-12-07, 2 cores, a
cold start): compile stalls make single prefill times 0.01-4.6 s with no order in
length. Fitted without constraints, that run's PD-P profile fell below zero at
the mean prompt length and the live rebalancer proposed t = 0 with a 7x "gain".
"""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.scheduling.calibration import FinishedRequest, _binned_points, fit_profiles
from paas_jax.scheduling.live_rebalance import rebalance_step, tiny_reference_profiles
from paas_jax.scheduling.profiles import PrefillProfile

# route, input tokens, output tokens, prefill_s, ttft_s, tpot_s, link bytes
DEMO_ROWS = [
    ("prfaas", 171, 32, 4.631, 6.082, 0.0065, 63484), ("pdp", 132, 32, 0.251, 2.3, 0.033, None),
    ("prfaas", 286, 32, 2.578, 8.633, 0.0339, 93836), ("prfaas", 168, 32, 0.122, 5.603, 0.0058, 62716),
    ("pdp", 88, 32, 0.78, 2.236, 0.0073, None), ("prfaas", 217, 32, 0.147, 5.224, 0.0048, 75260),
    ("prfaas", 556, 32, 0.268, 8.102, 0.0201, 182664), ("prfaas", 389, 32, 0.358, 8.2, 0.0109, 120208),
    ("pdp", 75, 32, 0.354, 1.474, 0.0073, None), ("pdp", 43, 32, 0.515, 1.381, 0.0069, None),
    ("pdp", 81, 32, 0.354, 1.634, 0.006, None), ("prfaas", 157, 32, 0.174, 7.588, 0.0103, 59900),
    ("pdp", 15, 32, 0.361, 2.492, 0.0046, None), ("pdp", 121, 32, 0.399, 2.384, 0.0043, None),
    ("pdp", 43, 32, 0.012, 2.356, 0.0045, None), ("pdp", 73, 32, 0.456, 2.251, 0.0032, None),
]
DEMO_LINK_BPS = 50e6
GRID = np.linspace(0.0, 2000.0, 401)


def _demo_requests() -> list[FinishedRequest]:
  return [FinishedRequest(route=r, input_tokens=n, output_tokens=o, prefill_s=p, ttft_s=t,
                          tpot_s=tp, link_bytes=b) for r, n, o, p, t, tp, b in DEMO_ROWS]


def _physical(profile: PrefillProfile) -> bool:
  t = profile.t_prefill(GRID)
  return bool(np.all(t >= 0.0) and np.all(np.diff(t) >= -1e-12))


def _profile(ls, ts, interpolation) -> PrefillProfile:
  return PrefillProfile(name="p", lengths=tuple(ls), prefill_seconds=tuple(ts),
                        kv_bytes=tuple(1e4 + 10.0 * l for l in ls), interpolation=interpolation)


def test_monotone_quadratic_is_least_squares_where_that_is_already_physical():
  ls = (1000.0, 8000.0, 32000.0, 128000.0)
  ts = tuple(0.3 + 4e-5 * l + 1e-10 * l * l for l in ls)
  free, monotone = _profile(ls, ts, "quadratic"), _profile(ls, ts, "monotone_quadratic")
  np.testing.assert_allclose(monotone.t_prefill(GRID * 64), free.t_prefill(GRID * 64),
                             rtol=1e-9)


def test_monotone_quadratic_neither_falls_nor_goes_negative_where_the_free_fit_does():
  # The demo's PD-P bins after isotonic regression: the free quadratic bends down.
  ls, ts = (43.0, 74.0, 84.5, 126.5), (0.3607, 0.405, 0.446, 0.446)
  free = _profile(ls, ts, "quadratic")
  assert not _physical(free)  # the control: this is what the fit used to give
  assert free.t_prefill(600.0) == 0.0  # clamped, no longer negative
  assert _physical(_profile(ls, ts, "monotone_quadratic"))


def test_piecewise_linear_extrapolation_is_clamped_at_zero():
  steep = _profile((43.0, 74.0), (0.01, 0.5), "piecewise_linear")
  assert steep.t_prefill(15.0) == 0.0
  assert steep.t_prefill(74.0) == pytest.approx(0.5)


def test_binned_points_of_the_demo_never_get_faster_with_length():
  for route in ("pdp", "prfaas"):
    rows = [r for r in _demo_requests() if r.route == route]
    ls, ts, _ = _binned_points(rows, 6, 2)
    assert np.all(np.diff(ls) > 0) and np.all(np.diff(ts) >= 0), (route, ls, ts)
    assert min(ts) > 0  # pooled medians: the profile's own check needs > 0


def test_fit_to_the_demo_is_physical_on_both_routes():
  prof = fit_profiles(_demo_requests(), tiny_reference_profiles(8),
                      link_bandwidth_bps=DEMO_LINK_BPS, min_requests_per_point=2)
  assert {"prfaas_prefill", "pdp_prefill"} <= set(prof.calibrated)
  for profile in (prof.prfaas_prefill, prof.pdp_prefill):
    assert profile.interpolation == "monotone_quadratic"
    assert _physical(profile), profile


def test_rebalancer_on_the_demo_proposes_from_positive_service_times():
  p = rebalance_step(_demo_requests(), threshold=150, n_slots=8,
                     link_bandwidth_bps=DEMO_LINK_BPS)
  assert p["status"] == "ok", p
  assert p["pdp_service_s"] > 0 and p["prfaas_service_s"] > 0, p
  # Offloading everything (t = 0) was the unphysical fit's answer.
  assert p["proposed_threshold"] > 0, p
