"""Eqs. 1-8 against hand computations, the grid searches, and the case-study reproduction."""

import dataclasses
import math

import numpy as np
import pytest

from paas_jax.scheduling import case_study as cs
from paas_jax.scheduling.distributions import EmpiricalLengths, TruncatedLogNormal
from paas_jax.scheduling.profiles import DecodeProfile, PrefillProfile, fit_time_map
from paas_jax.scheduling.throughput import (SystemModel, evaluate, select_offload_threshold,
                                            solve_deployment, theta_pdd, ttft_no_queue)


def _linear_profile(name, seconds_per_1k_tokens):
  # T(l) = seconds_per_1k_tokens * l / 1000; S_kv(l) = 1e6 * l bytes (c = 0, k = 1 MB/token).
  return PrefillProfile(name=name, lengths=(1000.0, 3000.0),
                        prefill_seconds=(seconds_per_1k_tokens, 3 * seconds_per_1k_tokens),
                        kv_bytes=(1e9, 3e9), interpolation="piecewise_linear")


def _crafted_system(link_bps=28e9):
  """Lengths {1000, 2000, 3000, 4000}; PrfaaS T = l/1000 s, PD-P T = 2l/1000 s;
  decode BS 10, 50 ms/step, 100 output tokens -> 2 req/s per decode instance."""
  return SystemModel(
      prfaas_profile=_linear_profile("fast", 1.0), pdp_profile=_linear_profile("slow", 2.0),
      decode_profile=DecodeProfile(max_batch_size=10, step_seconds=0.05),
      lengths=EmpiricalLengths((1000.0, 2000.0, 3000.0, 4000.0)), output_tokens=100,
      egress_bandwidth_bps=link_bps)


def test_eqs_1_to_8_by_hand():
  # t = 2500: p = 1/2, l_long = 3500, l_short = 1500.
  # Theta_prfaas = min(7 / 3.5 s, 28e9 b/s / (8 * 3.5e9 b)) = min(2.0, 1.0) = 1.0   (link-bound)
  # Theta_pdp    = 5 / 3.0 s = 5/3;  Theta_pdd = 2 * 10 / (0.05 * 100) = 4.0
  # Lambda_max   = min(1.0 / 0.5, (5/3) / 0.5, 4.0) = 2.0;  egress = 2 * 0.5 * 28e9 = 28e9 b/s
  b = evaluate(_crafted_system(), 2500.0, n_prfaas=7, n_p=5, n_d=2)
  assert b.offload_fraction == pytest.approx(0.5)
  assert b.l_long == pytest.approx(3500.0) and b.l_short == pytest.approx(1500.0)
  assert b.theta_prfaas_compute == pytest.approx(2.0)
  assert b.theta_prfaas_link == pytest.approx(1.0)
  assert b.theta_prfaas == pytest.approx(1.0)
  assert b.theta_pdp == pytest.approx(5.0 / 3.0)
  assert b.theta_pdd == pytest.approx(4.0)
  assert b.lambda_max == pytest.approx(2.0)
  assert b.bottleneck == "prfaas"
  assert b.egress_bps == pytest.approx(28e9)


def test_phi_kv_is_eq_1():
  prof = _linear_profile("fast", 1.0)
  # S_kv(2000) = 2e9 B = 16e9 b over T = 2 s -> 8 Gbps.
  assert float(prof.phi_kv_bps(2000.0)) == pytest.approx(8e9)


def test_theta_pdd_eq_7():
  assert theta_pdd(DecodeProfile(max_batch_size=20, step_seconds=0.025), 5, 1024) == pytest.approx(
      5 * 20 / (0.025 * 1024))


def test_threshold_search_picks_hand_computed_argmax():
  # Lambda_max by hand for N = 7/5/2 at each candidate t:
  #   t=0    p=1    : min(min(7/2.5, 28/20)/1, -, 4)           = 1.4
  #   t=1500 p=3/4  : min(min(7/3, 28/24)/0.75, (5/2)/0.25, 4) = 1.556
  #   t=2500 p=1/2  : min(1.0/0.5, (5/3)/0.5, 4)               = 2.0   <- argmax
  #   t=3500 p=1/4  : min(min(7/4, 28/32)/0.25, (5/4)/0.75, 4)  = 1.667
  #   t=4000 p=0    : min(-, 5/5, 4)                            = 1.0
  sysm = _crafted_system()
  grid = [0.0, 1500.0, 2500.0, 3500.0, 4000.0]
  expected = [1.4, 28 / 24 / 0.75, 2.0, 1.25 / 0.75, 1.0]
  got = [evaluate(sysm, t, 7, 5, 2).lambda_max for t in grid]
  assert np.allclose(got, expected)
  best = select_offload_threshold(sysm, 7, 5, 2, thresholds=grid)
  assert best.threshold_tokens == 2500.0
  assert best.lambda_max == pytest.approx(2.0)


def test_solve_deployment_matches_brute_force():
  sysm = _crafted_system()
  grid = np.arange(0.0, 4001.0, 250.0)
  plan = solve_deployment(sysm, n_prfaas=3, n_local=6, thresholds=grid)
  brute = max(evaluate(sysm, t, 3, n_p, 6 - n_p).lambda_max for n_p in range(6) for t in grid)
  assert plan.best.lambda_max == pytest.approx(brute)
  assert len(plan.candidates) == 6
  assert plan.best.n_p + plan.best.n_d == 6


def test_baselines_are_constrained_searches():
  sysm = _crafted_system()
  homo = solve_deployment(sysm, n_prfaas=0, n_local=6).best
  assert homo.offload_fraction == 0.0 and homo.n_prfaas == 0
  naive = solve_deployment(sysm, n_prfaas=3, n_local=6, n_p_choices=(0,)).best
  assert naive.offload_fraction == 1.0 and naive.n_p == 0 and naive.n_d == 6


def test_expected_mode_equals_paper_form_for_linear_t_and_is_lower_for_convex_t():
  lin = _crafted_system()
  a = evaluate(lin, 2500.0, 7, 5, 2)
  b = evaluate(dataclasses.replace(lin, prefill_time_mode="expected"), 2500.0, 7, 5, 2)
  assert b.lambda_max == pytest.approx(a.lambda_max, rel=1e-6)  # linear T: no Jensen gap
  convex = PrefillProfile(name="convex", lengths=(1000.0, 2000.0, 4000.0),
                          prefill_seconds=(1.0, 3.0, 11.0), kv_bytes=(1e9, 2e9, 4e9))
  cv = dataclasses.replace(lin, prfaas_profile=convex, pdp_profile=convex, egress_bandwidth_bps=1e15)
  at_mean = evaluate(cv, 0.0, 4, 0, 4)
  expected = evaluate(dataclasses.replace(cv, prefill_time_mode="expected"), 0.0, 4, 0, 4)
  assert expected.theta_prfaas < at_mean.theta_prfaas


def test_ttft_no_queue_by_hand():
  # t = 2500: 1000 and 2000 stay on PD-P (2 s, 4 s); 3000 and 4000 go to PrfaaS (3 s, 4 s).
  out = ttft_no_queue(_crafted_system(), 2500.0, quantiles=(0.9,))
  assert out["mean"] == pytest.approx((2 + 4 + 3 + 4) / 4)
  assert out["p90"] == pytest.approx(4.0, rel=1e-3)


def test_profile_fits():
  ls = (1000.0, 2000.0, 5000.0, 9000.0)
  quad = PrefillProfile(name="q", lengths=ls,
                        prefill_seconds=tuple(0.3 + 2e-4 * l + 3e-9 * l * l for l in ls),
                        kv_bytes=tuple(5e8 + 1e5 * l for l in ls))
  assert float(quad.t_prefill(7000.0)) == pytest.approx(0.3 + 1.4 + 3e-9 * 49e6, rel=1e-9)
  assert quad.kv_fixed_bytes == pytest.approx(5e8) and quad.kv_slope_bytes_per_token == pytest.approx(1e5)
  assert quad.fixed_overhead_seconds == pytest.approx(0.3, rel=1e-6)
  # A cached prefix saves exactly the compute of its tokens; the fixed overhead remains.
  assert float(quad.prefill_time(5000.0, 2000.0)) == pytest.approx(
      0.3 + float(quad.t_prefill(5000.0) - quad.t_prefill(2000.0)))
  pw = dataclasses.replace(quad, interpolation="piecewise_linear")
  assert np.allclose(pw.t_prefill(np.array(ls)), quad.prefill_seconds)
  slow = quad.with_time_map("slow", 3.0, -0.2)
  scale, offset = fit_time_map(quad.t_prefill([1500.0, 8000.0]), slow.t_prefill([1500.0, 8000.0]))
  assert scale == pytest.approx(3.0) and offset == pytest.approx(-0.2)


@pytest.mark.parametrize("bad", [
    dict(lengths=(2.0, 1.0), prefill_seconds=(1.0, 2.0), kv_bytes=(1.0, 2.0)),
    dict(lengths=(1.0, 2.0), prefill_seconds=(1.0, -2.0), kv_bytes=(1.0, 2.0)),
    dict(lengths=(1.0, 2.0), prefill_seconds=(1.0, 2.0), kv_bytes=(1.0,)),
    dict(lengths=(1.0, 2.0), prefill_seconds=(1.0, 2.0), kv_bytes=(1.0, 2.0), interpolation="quadratic"),
    dict(lengths=(1.0, 2.0, 3.0), prefill_seconds=(1.0, 2.0, 3.0), kv_bytes=(3.0, 2.0, 1.0)),
])
def test_bad_profiles_raise(bad):
  kwargs = dict(interpolation="piecewise_linear")
  kwargs.update(bad)
  with pytest.raises(ValueError):
    PrefillProfile(name="bad", **kwargs)


def test_bad_model_inputs_raise():
  sysm = _crafted_system()
  with pytest.raises(ValueError):
    evaluate(sysm, 100.0, -1, 2, 2)
  with pytest.raises(ValueError):
    solve_deployment(sysm, 2, 4, n_p_choices=(4,))
  with pytest.raises(ValueError):
    dataclasses.replace(sysm, output_tokens=0)
  with pytest.raises(ValueError):
    dataclasses.replace(sysm, prefill_time_mode="exact")


def test_table5_units():
  # Phi_kv recomputed from Table 5's S_kv (MiB = 2^20 B) and T (s) in Gbps (1e9 b/s).
  for ours, printed in cs.table5_phi_check():
    assert ours == pytest.approx(printed, abs=0.03)


def test_case_study_reproduces_table6_shape():
  case = cs.build_case_study()
  sysm = case.system
  pr = solve_deployment(sysm, case.n_prfaas, case.n_local).best
  homo = solve_deployment(sysm, 0, case.n_homogeneous).best
  naive = solve_deployment(sysm, case.n_prfaas, case.n_local, n_p_choices=(0,)).best
  assert (pr.n_prfaas, pr.n_p, pr.n_d) == (4, 3, 5)
  assert (homo.n_p, homo.n_d) == (9, 3)
  assert 18_000 <= pr.threshold_tokens <= 21_000
  assert 0.46 <= pr.offload_fraction <= 0.54
  assert 1.45 <= pr.lambda_max / homo.lambda_max <= 1.65
  assert 1.20 <= pr.lambda_max / naive.lambda_max <= 1.40
  assert 10e9 <= pr.egress_bps <= 15e9
  # The PrfaaS-PD column is not calibrated: its PD-P throughput is a prediction.
  assert pr.theta_pdp == pytest.approx(cs.PAPER_TABLE6["prfaas_pd"]["theta"][1], rel=0.05)
  assert case.assumptions["decode_max_batch_size"] == 20


def test_flop_ratio_h20_contradicts_table6():
  case = cs.build_case_study(h20_method="flop_ratio")
  homo = solve_deployment(case.system, 0, case.n_homogeneous).best
  assert homo.lambda_max < 0.5 * cs.PAPER_TABLE6["homogeneous"]["lambda_max"]


def test_distribution_drives_threshold():
  # Heavier tails push more long requests through PrfaaS: the offloaded fraction at the
  # optimum must rise and the chosen t must move with the distribution.
  case = cs.build_case_study()
  base = solve_deployment(case.system, 4, 8).best
  shorter = dataclasses.replace(case.system, lengths=TruncatedLogNormal(9.0, 1.0, 128, 131072))
  alt = solve_deployment(shorter, 4, 8).best
  assert alt.threshold_tokens < base.threshold_tokens
  assert math.isfinite(alt.lambda_max) and alt.lambda_max > base.lambda_max
