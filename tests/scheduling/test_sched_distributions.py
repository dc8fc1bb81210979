"""Length distributions: closed forms against hand values and Monte Carlo."""

import math

import numpy as np
import pytest

from paas_jax.scheduling.distributions import EmpiricalLengths, TruncatedLogNormal, norm_cdf


def test_norm_cdf_known_values():
  assert float(norm_cdf(0.0)) == pytest.approx(0.5, abs=1e-15)
  assert float(norm_cdf(1.959963984540054)) == pytest.approx(0.975, abs=1e-12)
  # The lower tail keeps relative precision (erfc-based), unlike 0.5*(1+erf(x)).
  assert float(norm_cdf(-10.0)) == pytest.approx(7.619853024160527e-24, rel=1e-9)


def test_symmetric_truncation_has_median_at_exp_mu():
  # Truncating symmetrically in log space keeps the median at e^mu exactly.
  d = TruncatedLogNormal(mu=9.0, sigma=0.7, lo=math.exp(9.0 - 1.3), hi=math.exp(9.0 + 1.3))
  assert float(d.prob_greater(math.exp(9.0))) == pytest.approx(0.5, abs=1e-12)
  assert float(d.quantile(0.5)) == pytest.approx(math.exp(9.0), rel=1e-9)


def test_wide_truncation_recovers_lognormal_mean():
  mu, sigma = 5.0, 0.8
  d = TruncatedLogNormal(mu, sigma, lo=math.exp(mu - 12 * sigma), hi=math.exp(mu + 12 * sigma))
  assert d.mean() == pytest.approx(math.exp(mu + sigma**2 / 2), rel=1e-10)


def test_conditional_means_match_monte_carlo():
  d = TruncatedLogNormal(9.9, 1.0, 128, 131072)
  x = d.sample(np.random.default_rng(0), 400_000)
  assert x.min() >= 128 and x.max() <= 131072
  for t in (5_000.0, 19_400.0, 60_000.0):
    assert float(d.prob_greater(t)) == pytest.approx(np.mean(x > t), abs=4e-3)
    assert float(d.mean_between(t, math.inf)) == pytest.approx(x[x > t].mean(), rel=5e-3)
    assert float(d.mean_between(0, t)) == pytest.approx(x[x <= t].mean(), rel=5e-3)
  # Law of total expectation ties the two conditional means to the overall mean.
  t = 19_400.0
  p = float(d.prob_greater(t))
  total = p * float(d.mean_between(t, math.inf)) + (1 - p) * float(d.mean_between(0, t))
  assert total == pytest.approx(d.mean(), rel=1e-10)


def test_expect_identity_equals_closed_form_mean():
  d = TruncatedLogNormal(9.9, 1.0, 128, 131072)
  assert d.expect(lambda l: l, 19_400.0, math.inf) == pytest.approx(
      float(d.mean_between(19_400.0, math.inf)), rel=1e-8)


def test_quantile_inverts_cdf_and_sampling_is_seeded():
  d = TruncatedLogNormal(9.9, 1.0, 128, 131072)
  q = np.array([0.01, 0.3, 0.9, 0.999])
  assert np.allclose(d.cdf(d.quantile(q)), q, atol=1e-10)
  a = d.sample(np.random.default_rng(7), 1000)
  b = d.sample(np.random.default_rng(7), 1000)
  c = d.sample(np.random.default_rng(8), 1000)
  assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("kwargs", [
    dict(mu=1.0, sigma=0.0, lo=1.0, hi=2.0),
    dict(mu=1.0, sigma=1.0, lo=2.0, hi=1.0),
    dict(mu=1.0, sigma=1.0, lo=0.0, hi=5.0),
    dict(mu=1.0, sigma=1.0, lo=1.0, hi=math.inf),
])
def test_truncated_lognormal_rejects_bad_parameters(kwargs):
  with pytest.raises(ValueError):
    TruncatedLogNormal(**kwargs)


def test_empirical_lengths_hand_values():
  d = EmpiricalLengths((1.0, 2.0, 3.0, 4.0, 10.0))
  assert float(d.prob_greater(3.0)) == pytest.approx(0.4)
  assert float(d.mean_between(0.0, 3.0)) == pytest.approx(2.0)
  assert float(d.mean_between(3.0, math.inf)) == pytest.approx(7.0)
  assert d.expect(lambda l: l * l, 3.0, None) == pytest.approx((16 + 100) / 2)
  assert math.isnan(float(d.mean_between(10.0, math.inf)))
  with pytest.raises(ValueError):
    EmpiricalLengths(())
  with pytest.raises(ValueError):
    EmpiricalLengths((1.0, -2.0))
