"""Arrival processes and prefix hotspots."""

import numpy as np
import pytest

from paas_jax.scheduling.distributions import TruncatedLogNormal
from paas_jax.simulation.workload import (GammaArrivals, OnOffArrivals, PoissonArrivals, PrefixHotspots,
                                          WorkloadSpec, generate_requests)


def _ok(times, duration):
  assert np.all(np.diff(times) >= 0) and times.min() >= 0 and times.max() < duration


def test_poisson_and_gamma_rates_and_burstiness():
  rng = np.random.default_rng(0)
  p = PoissonArrivals(5.0).times(2000.0, rng)
  _ok(p, 2000.0)
  assert abs(p.size - 10_000) < 4 * np.sqrt(10_000)
  g = GammaArrivals(5.0, cv=3.0).times(4000.0, rng)
  _ok(g, 4000.0)
  gaps = np.diff(g)
  assert gaps.mean() == pytest.approx(0.2, rel=0.1)
  assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_on_off_mean_rate_and_phases():
  proc = OnOffArrivals(rate_on=8.0, rate_off=0.0, on_s=10.0, off_s=10.0)
  assert proc.mean_rate == pytest.approx(4.0)
  t = proc.times(1000.0, np.random.default_rng(1))
  _ok(t, 1000.0)
  assert np.all((t % 20.0) < 10.0)  # nothing during off phases
  assert abs(t.size - 4000) < 4 * np.sqrt(4000)


def test_hotspots_follow_zipf_and_are_seeded():
  spec = WorkloadSpec(arrivals=PoissonArrivals(10.0), lengths=TruncatedLogNormal(9.9, 1.0, 128, 131072),
                      output_tokens=16, duration_s=500.0,
                      hotspots=PrefixHotspots(num_prefixes=8, zipf_s=1.5, share_prob=0.8))
  a = generate_requests(spec, np.random.default_rng(5))
  b = generate_requests(spec, np.random.default_rng(5))
  assert a == b
  ids = np.array([r.prefix_id for r in a])
  counts = np.bincount(ids[ids >= 0], minlength=8)
  assert counts[0] == counts.max() and counts[0] > 2 * counts[7]
  assert all(r.shared_tokens <= 0.9 * r.input_tokens for r in a)
  assert all((r.prefix_id >= 0) == (r.shared_tokens > 0) for r in a)


def test_workload_validation():
  with pytest.raises(ValueError):
    PoissonArrivals(0.0)
  with pytest.raises(ValueError):
    WorkloadSpec(arrivals=PoissonArrivals(1.0), lengths=TruncatedLogNormal(9.9, 1.0, 128, 1e5),
                 output_tokens=1, duration_s=10.0)
