"""Mamba2 SSD: token-by-token recurrence vs chunked XLA form vs Pallas kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_util import PallasCase, assert_close, lower_for_platform, ssd_inputs
from pallas_kernels import last_impl
from pallas_kernels.ssd import ssd, ssd_step
from pallas_kernels.ssd.reference import ssd_naive as _ssd_naive

# Module-level jits: tests sharing shapes share compiles.
ssd_naive = jax.jit(_ssd_naive)
_ssd = jax.jit(ssd, static_argnames=("chunk_size", "impl"))
_step = jax.jit(ssd_step, static_argnames=("impl",))


class SsdBase:
  """Checks a chunked implementation (``IMPL``) against the recurrence."""

  IMPL = "xla"

  def chunked(self, x, dt, a, bm, cm, s0, chunk_size=64):
    return _ssd(x, dt, a, bm, cm, initial_state=s0, chunk_size=chunk_size, impl=self.IMPL)

  # seq not a multiple of the chunk, one and several heads per group, t = 1.
  @pytest.mark.parametrize("t,chunk,h,g", [(75, 32, 4, 1), (40, 16, 4, 2), (1, 16, 2, 2)])
  def test_matches_recurrence(self, t, chunk, h, g):
    x, dt, a, bm, cm, s0 = ssd_inputs(0, 2, t, h, 16, g, 8)
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
    y, s = self.chunked(x, dt, a, bm, cm, s0, chunk_size=chunk)
    assert y.dtype == x.dtype and s.dtype == jnp.float32
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert_close(y, y_ref, what="output")
    assert_close(s, s_ref, what="final state")

  def test_bf16_inputs(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(1, 1, 50, 4, 32, 2, 16, dtype=jnp.bfloat16)
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
    y, s = self.chunked(x, dt, a, bm, cm, s0, chunk_size=16)
    assert y.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert_close(y, y_ref, jnp.bfloat16, what="output")
    assert_close(s, s_ref, jnp.float32, tol=1e-4, what="final state")

  def test_split_prefill_continues_exactly(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(2, 1, 45, 2, 8, 1, 4)
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
    cut = 21
    y1, s1 = self.chunked(x[:, :cut], dt[:, :cut], a, bm[:, :cut], cm[:, :cut], s0, chunk_size=16)
    y2, s2 = self.chunked(x[:, cut:], dt[:, cut:], a, bm[:, cut:], cm[:, cut:], s1, chunk_size=16)
    assert_close(np.concatenate([y1, y2], axis=1), y_ref, what="output")
    assert_close(s2, s_ref, what="final state")

  def test_strong_decay_stays_finite(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(3, 1, 64, 2, 16, 1, 8)
    dt = dt + 5.0  # dt * A down to about -20 per step: about -1300 over a chunk
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
    y, s = self.chunked(x, dt, a, bm, cm, s0, chunk_size=32)
    assert_close(y, y_ref, what="output")
    assert_close(s, s_ref, tol=1e-4, what="final state")


class TestSsdXla(SsdBase):
  IMPL = "xla"

  def test_auto_resolves_to_xla_on_cpu(self):
    if jax.default_backend() != "cpu":
      pytest.skip("platform-specific resolution")
    x, dt, a, bm, cm, _ = ssd_inputs(0, 1, 4, 2, 4, 1, 4)
    jax.eval_shape(functools.partial(ssd, impl="auto"), x, dt, a, bm, cm)
    assert last_impl("ssd") == "xla"

  def test_zero_dt_leaves_state_unchanged(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(4, 1, 9, 2, 4, 2, 4)
    _, s = _ssd(x, np.zeros_like(dt), a, bm, cm, initial_state=s0)
    assert_close(s, s0, tol=1e-7, what="state")

  def test_bad_shapes_raise(self):
    x, dt, a, bm, cm, _ = ssd_inputs(0, 1, 4, 3, 4, 1, 4)
    with pytest.raises(ValueError, match="multiple of groups"):
      ssd(x, dt, a, np.concatenate([bm, bm], 2), np.concatenate([cm, cm], 2))
    with pytest.raises(ValueError, match="A must be"):
      ssd(x, dt, a[:2], bm, cm)


class SsdPallas(PallasCase, SsdBase):
  SLOW_IN_INTERPRET = ("test_split_prefill_continues_exactly",)

  def test_records_path(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(0, 1, 16, 2, 16, 1, 16)
    jax.eval_shape(functools.partial(ssd, chunk_size=16, impl=self.IMPL), x, dt, a, bm, cm,
                   initial_state=s0)
    assert last_impl("ssd") == self.PATH


class TestSsdPallasTpu(SsdPallas):
  FORM = "tpu"


class TestSsdPallasTpuInterpret(TestSsdPallasTpu):
  INTERPRET = True


class TestSsdPallasGpu(SsdPallas):
  FORM = "gpu"


class TestSsdPallasGpuInterpret(TestSsdPallasGpu):
  INTERPRET = True


@pytest.mark.parametrize("platform,backend", [("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_kernels_lower_for_accelerators(platform, backend):
  from pallas_kernels.ssd.kernel import ssd_pallas  # pylint: disable=g-import-not-at-top
  spec = jax.ShapeDtypeStruct
  b, t, h, p, g, n = 1, 256, 8, 64, 2, 128

  def fn(x, dt, a, bm, cm, s0):
    return ssd_pallas(x, dt, a, bm, cm, initial_state=s0, backend=backend)

  lower_for_platform(platform, fn, spec((b, t, h, p), jnp.bfloat16), spec((b, t, h), jnp.float32),
                     spec((h,), jnp.float32), spec((b, t, g, n), jnp.bfloat16),
                     spec((b, t, g, n), jnp.bfloat16), spec((b, h, p, n), jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas_tpu_interpret", "pallas_gpu_interpret"])
@pytest.mark.parametrize("t,h,p,g,n,chunk", [(500, 8, 64, 2, 128, 64), (100, 6, 60, 3, 100, 32)])
def test_sweep_against_recurrence(impl, t, h, p, g, n, chunk):
  _sweep_case(impl, t, h, p, g, n, chunk)


# The sweep reduced for the default suite (issue 12): both interpreted kernels on the
# sweep's odd shapes (head dim 60, state 100, 3 groups, seq not a chunk multiple),
# shortened; the full sweep stays slow.
@pytest.mark.parametrize("impl,t,h,p,g,n,chunk", [("pallas_tpu_interpret", 70, 6, 60, 3, 100, 32),
                                                  ("pallas_gpu_interpret", 70, 6, 60, 3, 100, 32)])
def test_sweep_reduced(impl, t, h, p, g, n, chunk):
  _sweep_case(impl, t, h, p, g, n, chunk)


def _sweep_case(impl, t, h, p, g, n, chunk):
  x, dt, a, bm, cm, s0 = ssd_inputs(11, 1, t, h, p, g, n)
  y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
  y, s = _ssd(x, dt, a, bm, cm, initial_state=s0, chunk_size=chunk, impl=impl)
  assert_close(y, y_ref, what="output")
  assert_close(s, s_ref, what="final state")


class TestSsdStep:

  def test_steps_match_recurrence(self):
    x, dt, a, bm, cm, s0 = ssd_inputs(5, 2, 5, 4, 8, 2, 4)
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, initial_state=s0)
    s = s0
    ys = []
    for i in range(x.shape[1]):
      y, s = _step(x[:, i], dt[:, i], a, bm[:, i], cm[:, i], s)
      ys.append(y)
    assert s.dtype == jnp.float32
    assert_close(np.stack(ys, 1), y_ref, what="output")
    assert_close(s, s_ref, what="state")

  def test_group_mapping(self):
    # Head i must read group i // (h // g): give the groups different B/C and
    # check each head against a one-head, one-group computation.
    x, dt, a, bm, cm, s0 = ssd_inputs(6, 1, 1, 4, 2, 2, 3)
    y, s = _step(x[:, 0], dt[:, 0], a, bm[:, 0], cm[:, 0], s0)
    for head in range(4):
      grp = head // 2
      y1, s1 = _step(x[:, 0, head:head + 1], dt[:, 0, head:head + 1], a[head:head + 1],
                     bm[:, 0, grp:grp + 1], cm[:, 0, grp:grp + 1], s0[:, head:head + 1])
      assert_close(y[:, head:head + 1], y1, tol=1e-6, what=f"head {head}")
      assert_close(s[:, head:head + 1], s1, tol=1e-6, what=f"head {head} state")
