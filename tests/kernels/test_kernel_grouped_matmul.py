"""Grouped matmul: numpy loop vs reference vs tiled XLA form vs Pallas kernels.

Tolerances: inputs are f32 (or bf16 rounded identically on both sides) and
every path accumulates in f32, so f32 results agree to reassociation
(``TOL`` 2e-5 RMS relative); bf16 outputs add one output rounding (1.5e-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_util import PallasCase, assert_close, lower_for_platform, rms_rel_err
from pallas_kernels import last_impl
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul.kernel import grouped_matmul_pallas
from pallas_kernels.grouped_matmul.reference import default_tile, visit_metadata

_gmm = jax.jit(grouped_matmul, static_argnames=("tile", "out_dtype", "impl"))


def gmm_numpy(x, w, sizes):
  """The definition, group by group, in f64."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for e, size in enumerate(sizes):
    out[start:start + size] = x[start:start + size] @ w[e]
    start += size
  return out


def inputs(seed, m, k, n, sizes, dtype=np.float32):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
  w = rng.standard_normal((len(sizes), k, n), dtype=np.float32).astype(dtype)
  return x, w, np.asarray(sizes, np.int32)


# (m, k, n, group sizes): empty groups first / middle / last, one group
# holding everything, rows past the last group, a single row, all groups empty.
CASES = {
    "mixed_empty": (37, 24, 20, [7, 0, 13, 2, 10]),
    "first_last_empty": (40, 16, 8, [0, 20, 20, 0]),
    "one_group_all": (33, 8, 12, [0, 0, 33]),
    "trailing_rows": (50, 16, 16, [3, 4, 5]),
    "single_row": (1, 8, 8, [0, 1, 0]),
    "all_empty": (9, 8, 8, [0, 0, 0, 0]),
    "many_groups": (64, 32, 24, [1, 0, 3, 9, 0, 0, 2, 17, 5, 5, 0, 22]),
}


class GroupedMatmulBase:
  IMPL = "xla"
  TILES = (8, 16)

  @pytest.mark.parametrize("case", sorted(CASES))
  def test_matches_definition(self, case):
    m, k, n, sizes = CASES[case]
    x, w, gs = inputs(0, m, k, n, sizes)
    want = gmm_numpy(x, w, sizes)
    for tile in self.TILES:
      got = _gmm(x, w, gs, tile=tile, impl=self.IMPL)
      assert got.shape == (m, n) and got.dtype == jnp.float32
      assert_close(got, want, what=f"{case} tile={tile}")
      # Rows of no group are exactly zero, not merely small.
      assert np.all(np.asarray(got)[sum(sizes):] == 0.0)

  def test_bf16(self):
    x, w, gs = inputs(1, 48, 32, 16, [10, 0, 30, 8], dtype=jnp.bfloat16)
    got = _gmm(x, w, gs, tile=16, impl=self.IMPL)
    assert got.dtype == jnp.bfloat16
    assert_close(got, gmm_numpy(x.astype(np.float32), w.astype(np.float32), gs), jnp.bfloat16)

  def test_wrong_group_sizes_are_detected(self):
    # Negative control: one row moved to the neighbouring group.
    x, w, gs = inputs(2, 30, 16, 16, [10, 10, 10])
    got = _gmm(x, w, np.asarray([11, 9, 10], np.int32), tile=8, impl=self.IMPL)
    assert rms_rel_err(got, gmm_numpy(x, w, gs)) > 1e-2


class TestGroupedMatmulXla(GroupedMatmulBase):
  IMPL = "xla"
  TILES = (8, 16, 32)

  def test_reference_matches_definition_and_ragged_dot(self):
    m, k, n, sizes = CASES["mixed_empty"]
    x, w, gs = inputs(3, m, k, n, sizes)
    ref = _gmm(x, w, gs, impl="reference")
    assert_close(ref, gmm_numpy(x, w, sizes), what="reference")
    assert_close(ref, jax.lax.ragged_dot(x, w, gs), what="ragged_dot")
    assert last_impl("grouped_matmul") == "reference"

  def test_auto_is_xla_on_cpu(self):
    if jax.default_backend() != "cpu":
      pytest.skip("platform-specific resolution")
    x, w, gs = inputs(0, 8, 8, 8, [4, 4])
    jax.eval_shape(functools.partial(grouped_matmul, impl="auto"), x, w, gs)
    assert last_impl("grouped_matmul") == "xla"

  def test_visit_count_is_bounded_by_rows_not_groups(self):
    # 64 rows in tiles of 8 over 12 groups: at most 8 + 11 visits, and here
    # exactly one per (group, tile) intersection.
    gs = np.asarray(CASES["many_groups"][3], np.int32)
    vg, vt, nv = jax.jit(visit_metadata, static_argnums=(1, 2))(gs, 64, 8)
    assert vg.shape == (8 + 12 - 1,)
    ends = np.cumsum(gs)
    starts = ends - gs
    pairs = {(e, t) for e in range(12) for t in range(8)
             if gs[e] and starts[e] < 8 * (t + 1) and ends[e] > 8 * t}
    assert int(nv) == len(pairs)
    assert set(zip(np.asarray(vg)[:int(nv)].tolist(), np.asarray(vt)[:int(nv)].tolist())) == pairs

  def test_default_tile(self):
    assert default_tile(2048, 64) == 32 and default_tile(4, 64) == 8
    assert default_tile(1 << 20, 8) == 128

  def test_bad_shapes_raise(self):
    x, w, gs = inputs(0, 8, 8, 8, [4, 4])
    with pytest.raises(ValueError, match="contraction"):
      grouped_matmul(x[:, :4], w, gs)
    with pytest.raises(ValueError, match="one entry per group"):
      grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="impl"):
      grouped_matmul(x, w, gs, impl="cuda")


class GroupedMatmulPallas(PallasCase, GroupedMatmulBase):
  TILES = (8, 16)

  def test_records_path(self):
    x, w, gs = inputs(0, 16, 16, 16, [8, 8])
    jax.eval_shape(functools.partial(grouped_matmul, tile=16, impl=self.IMPL), x, w, gs)
    assert last_impl("grouped_matmul") == self.PATH


class TestGroupedMatmulPallasTpu(GroupedMatmulPallas):
  FORM = "tpu"


class TestGroupedMatmulPallasTpuInterpret(TestGroupedMatmulPallasTpu):
  INTERPRET = True


class TestGroupedMatmulPallasGpu(GroupedMatmulPallas):
  FORM = "gpu"
  TILES = (16, 32)


class TestGroupedMatmulPallasGpuInterpret(TestGroupedMatmulPallasGpu):
  INTERPRET = True


@pytest.mark.parametrize("platform,backend", [("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_kernels_lower_for_accelerators(platform, backend):
  spec = jax.ShapeDtypeStruct

  def fn(x, w, gs):
    return grouped_matmul_pallas(x, w, gs, tile=64, backend=backend)

  lower_for_platform(platform, fn, spec((512, 256), jnp.bfloat16),
                     spec((16, 256, 512), jnp.bfloat16), spec((16,), jnp.int32))
