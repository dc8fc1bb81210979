"""The compile-small UT-transform inverse equals the old unrolled form.

``unit_lower_inverse`` (stacked halves, rolled forward substitution) must give
the same T = (I + A)^{-1} as ``unit_lower_inverse_unrolled`` (the pre-#17
formula) and as numpy's inverse, on well-conditioned and on correlated-key
matrices, for even, odd and leaf-sized n; the whole chunked gated delta rule
must give the same outputs with either inverse.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernel_test_util import assert_close, gated_delta_inputs
from pallas_kernels.gated_delta import reference


def _a_matrix(seed, n, lead=(2, 3), correlated=False):
  rng = np.random.default_rng(seed)
  if correlated:
    k = rng.standard_normal((1, 8)) + 0.05 * rng.standard_normal(lead + (n, 8))
  else:
    k = rng.standard_normal(lead + (n, 8))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  beta = rng.uniform(0.0, 0.99, lead + (n, 1))
  return np.tril(beta * (k @ np.swapaxes(k, -1, -2)), -1).astype(np.float32)


@pytest.mark.parametrize("n,correlated", [(64, False), (64, True), (16, False), (7, False),
                                          (50, True), (32, True)])
def test_blocked_inverse_matches_unrolled_and_numpy(n, correlated):
  a = _a_matrix(n, n, correlated=correlated)
  new = np.asarray(jax.jit(reference.unit_lower_inverse)(a))
  old = np.asarray(jax.jit(reference.unit_lower_inverse_unrolled)(a))
  want = np.linalg.inv(np.eye(n) + a.astype(np.float64))
  np.testing.assert_allclose(new, old, rtol=0, atol=2e-6)
  assert_close(new, want, tol=1e-5)
  assert np.all(np.triu(new, 1) == 0.0) and np.all(np.diagonal(new, axis1=-2, axis2=-1) == 1.0)


def test_negative_control_one_wrong_row_is_detected():
  a = _a_matrix(0, 64)
  new = np.asarray(jax.jit(reference.unit_lower_inverse)(a))
  broken = new.copy()
  broken[..., 40, :] = np.eye(64)[40]  # row 40 left as identity
  want = np.linalg.inv(np.eye(64) + a.astype(np.float64))
  assert np.max(np.abs(broken - want)) > 1e-3


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunked_rule_same_with_either_inverse(per_channel):
  q, k, v, g, beta, s0 = gated_delta_inputs(5, 1, 70, 2, 16, 16, per_channel=per_channel,
                                            g_min=-0.5)
  outs = {}
  for name in ("unrolled", "blocked"):
    reference.set_chunk_inverse(name)
    try:
      fn = jax.jit(functools.partial(reference.chunk_gated_delta_xla, chunk_size=32))
      outs[name] = fn(q, k, v, g, beta, initial_state=s0)
    finally:
      reference.set_chunk_inverse("blocked")
  for got, want in zip(outs["blocked"], outs["unrolled"]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_unknown_inverse_raises():
  with pytest.raises(ValueError, match="chunk inverse"):
    reference.set_chunk_inverse("lu")
