"""The sort-free sampler (``paas_jax.models.sampler``): its kept sets equal a
float64 numpy reference of top-k / top-p, and its draws follow the renormalised
distribution over them. Each check has a negative control on a broken sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax.models import api, sampler


def _reference_kept(logits, temperature, top_k, top_p) -> np.ndarray:
  """bool [batch, vocab] from the definitions, in float64: the top_k highest
  scaled logits (ties at the boundary kept), then the tokens whose more
  probable tokens hold less than top_p of the top-k mass (top_p >= 1: all)."""
  logits = np.asarray(logits, np.float64)
  out = np.zeros(logits.shape, bool)
  for r, row in enumerate(logits):
    s = row / max(float(temperature[r]), 1e-6)
    k = int(top_k[r])
    keep = np.ones(s.shape, bool) if k <= 0 else s >= np.sort(s)[::-1][min(k, len(s)) - 1]
    p = np.where(keep, np.exp(s - s.max()), 0.0)
    p /= p.sum()
    if float(top_p[r]) < 1.0:
      order = np.argsort(s)
      tail = np.append(np.cumsum(p[order][::-1])[::-1], 0.0)  # tail[j]: mass of order[j:]
      above = tail[np.searchsorted(s[order], s, side="right")]  # mass of s > s[i]
      keep &= above < float(top_p[r])
    out[r] = keep
  return out


def _settings(seed: int, n: int, vocab: int):
  rng = np.random.RandomState(seed)
  logits = jax.random.normal(jax.random.key(seed), (n, vocab)) * (1 + seed % 4)
  temperature = jnp.asarray(rng.uniform(0.3, 2.0, n), jnp.float32)
  top_k = jnp.asarray(rng.choice([0, 1, 2, 7, 50, vocab - 1, vocab, 2 * vocab], n), jnp.int32)
  top_p = jnp.asarray(rng.choice([1.0, 0.95, 0.5, 0.1, 0.999, 1e-6], n), jnp.float32)
  return logits, temperature, top_k, top_p


@pytest.mark.parametrize("vocab", [2, 17, 500, 4099])
def test_kept_set_equals_the_definition(vocab):
  for seed in range(6):
    args = _settings(seed, 8, vocab)
    got = np.asarray(sampler.kept_mask(*args))
    np.testing.assert_array_equal(got, _reference_kept(*(np.asarray(a) for a in args)))
    assert got.any(axis=-1).all()  # the most probable token always stays


def test_kept_set_keeps_ties_and_extremes():
  logits = jnp.asarray([[1.0, 3.0, 3.0, 2.0, -jnp.inf],
                        [0.0, 0.0, 0.0, 0.0, 0.0],
                        [-1e30, 5.0, -3.0, 1e30, 0.0]], jnp.float32)
  n = logits.shape[0]
  for top_k, top_p in [(1, 1.0), (2, 1.0), (3, 1.0), (0, 0.5), (0, 0.7), (4, 0.99)]:
    args = (logits, jnp.ones(n), jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p))
    np.testing.assert_array_equal(np.asarray(sampler.kept_mask(*args)),
                                  _reference_kept(*(np.asarray(a) for a in args)))


def test_negative_control_kept_set_check_catches_a_sampler_ignoring_top_k_or_top_p():
  logits, temperature, top_k, top_p = _settings(1, 8, 500)
  want = _reference_kept(*(np.asarray(a) for a in (logits, temperature, top_k, top_p)))
  no_top_k = np.asarray(sampler.kept_mask(logits, temperature, jnp.zeros_like(top_k), top_p))
  no_top_p = np.asarray(sampler.kept_mask(logits, temperature, top_k, jnp.ones_like(top_p)))
  assert not np.array_equal(no_top_k, want)
  assert not np.array_equal(no_top_p, want)


def _draw_frequencies(sample_fn, logits_row, temperature, top_k, top_p, n=20000):
  logits = jnp.asarray(logits_row, jnp.float32)[None].repeat(n, 0)
  keys = api.sampling_keys(7, jnp.arange(n, dtype=jnp.int32))
  got = np.asarray(sample_fn(logits, keys, jnp.full(n, temperature), jnp.full(n, top_k, jnp.int32),
                             jnp.full(n, top_p)))
  return np.bincount(got, minlength=len(logits_row)) / n


def _expected(logits_row, temperature, top_k, top_p):
  keep = _reference_kept(np.asarray(logits_row)[None], [temperature], [top_k], [top_p])[0]
  s = np.asarray(logits_row, np.float64) / temperature
  p = np.where(keep, np.exp(s - s.max()), 0.0)
  return p / p.sum()


# 20000 draws: the standard error of a frequency is <= 0.0036, so 0.015 is ~4 sigma.
ATOL = 0.015
ROW = np.log([0.05, 0.3, 0.02, 0.2, 0.13, 0.3])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0),
                                                     (1.5, 3, 1.0), (1.0, 0, 0.75),
                                                     (1.2, 4, 0.9)])
def test_draws_follow_the_renormalised_distribution(temperature, top_k, top_p):
  freq = _draw_frequencies(api.sample_tokens, ROW, temperature, top_k, top_p)
  want = _expected(ROW, temperature, top_k, top_p)
  np.testing.assert_allclose(freq, want, atol=ATOL)
  assert (freq[want == 0] == 0).all()


def test_negative_control_distribution_check_catches_a_uniform_draw():
  # A broken draw: uniform over the kept set instead of proportional to it.
  def uniform_over_kept(logits, keys, temperature, top_k, top_p):
    keep = sampler.kept_mask(logits, temperature, top_k, top_p)
    return sampler.sample_tokens(jnp.where(keep, 0.0, -jnp.inf), keys, jnp.ones_like(temperature),
                                 jnp.zeros_like(top_k), jnp.ones_like(top_p))
  freq = _draw_frequencies(uniform_over_kept, ROW, 1.0, 0, 1.0)
  assert np.abs(freq - _expected(ROW, 1.0, 0, 1.0)).max() > ATOL


def test_sorting_sampler_keeps_the_same_sets_and_draws_the_same_distribution():
  # The baseline the benchmarks compare against samples the same distribution
  # (other tokens for the same keys: it draws over the sorted order).
  freq = _draw_frequencies(api.sample_tokens_sorted, ROW, 1.2, 4, 0.9)
  np.testing.assert_allclose(freq, _expected(ROW, 1.2, 4, 0.9), atol=ATOL)
  args = _settings(3, 8, 500)
  args = args[:3] + (jnp.minimum(args[3], 0.95),)  # f32 cumsum can drop tails at top_p=1
  _, ids, keep = sampler.sorted_kept_mask(*args)
  ref = np.zeros((8, 500), bool)
  for r in range(8):
    ref[r, np.asarray(ids[r])[np.asarray(keep[r])]] = True
  np.testing.assert_array_equal(np.asarray(sampler.kept_mask(*args)), ref)
