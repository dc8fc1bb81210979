"""Long-timescale re-solving from measured samples."""

import dataclasses

import numpy as np
import pytest

from paas_jax.scheduling import case_study as cs
from paas_jax.scheduling.distributions import TruncatedLogNormal
from paas_jax.scheduling.rebalancer import Rebalancer
from paas_jax.scheduling.throughput import solve_deployment


@pytest.fixture(scope="module")
def case():
  return cs.build_case_study()


def test_samples_recover_the_analytic_plan(case):
  analytic = solve_deployment(case.system, case.n_prfaas, case.n_local).best
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local)
  samples = case.system.lengths.sample(np.random.default_rng(0), 20_000)
  prop = rb.propose(analytic.threshold_tokens, analytic.n_p, samples)
  assert (prop.plan.n_p, prop.plan.n_d) == (analytic.n_p, analytic.n_d)
  assert abs(prop.plan.threshold_tokens - analytic.threshold_tokens) < 1_500
  assert not prop.apply  # already at the optimum: hysteresis holds


def test_shifted_workload_triggers_a_change(case):
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local)
  analytic = solve_deployment(case.system, case.n_prfaas, case.n_local).best
  shifted = TruncatedLogNormal(10.6, 1.0, 128, 131072).sample(np.random.default_rng(1), 5_000)
  prop = rb.propose(analytic.threshold_tokens, analytic.n_p, shifted)
  assert prop.apply and prop.relative_gain > rb.min_relative_gain
  assert prop.plan.lambda_max > prop.current.lambda_max
  assert prop.plan.threshold_tokens > analytic.threshold_tokens  # longer traffic, higher t


def test_measured_profiles_and_split_pinning(case):
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local)
  samples = case.system.lengths.sample(np.random.default_rng(2), 5_000)
  slower_h20 = case.system.pdp_profile.with_time_map("8xH20-slow", 1.5)
  prop = rb.propose(19_000, 3, samples, pdp_profile=slower_h20, n_p_choices=(3,))
  assert prop.plan.n_p == 3
  base = rb.propose(19_000, 3, samples, n_p_choices=(3,))
  # A slower PD-P must shift work to PrfaaS: the re-solved t drops.
  assert prop.plan.threshold_tokens < base.plan.threshold_tokens


def test_rebalancer_validates(case):
  rb = Rebalancer(case.system, case.n_prfaas, case.n_local, min_samples=100)
  with pytest.raises(ValueError):
    rb.propose(19_000, 3, np.full(10, 5_000.0))
  with pytest.raises(ValueError):
    rb.propose(19_000, 8, np.full(200, 5_000.0))
  with pytest.raises(ValueError):
    dataclasses.replace(rb, min_relative_gain=-1.0)
