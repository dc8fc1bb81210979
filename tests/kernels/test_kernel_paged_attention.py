"""Paged decode attention (GQA and absorbed MLA) vs contiguous-cache references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_util import (PallasCase, assert_close, attention_inputs, attention_numpy,
                              lower_for_platform, scatter_to_pages)
from pallas_kernels import last_impl
from pallas_kernels.paged_attention import paged_attention, paged_mla_attention

# Module-level jits: tests sharing shapes share compiles.
_paged = jax.jit(paged_attention, static_argnames=("sm_scale", "window", "impl"))
_mla = jax.jit(paged_mla_attention, static_argnames=("sm_scale", "impl"))


def _case(seed, lengths, n, hq, hkv, d, page_size, dtype=jnp.float32):
  """Random contiguous caches of capacity max(lengths) scattered into pages."""
  lengths = np.asarray(lengths, np.int32)
  b, s = len(lengths), int(lengths.max())
  q, k, v = attention_inputs(seed, b, n, s, hq, hkv, d, dtype=dtype)
  num_pages = b * (-(-s // page_size)) + 3
  k_pages, table = scatter_to_pages(seed, k, page_size, num_pages)
  v_pages, table_v = scatter_to_pages(seed, v, page_size, num_pages)
  assert np.array_equal(np.asarray(table), np.asarray(table_v))
  q_pos = lengths[:, None] - n + np.arange(n)[None, :]
  kv_pos = np.where(np.arange(s)[None, :] < lengths[:, None], np.arange(s)[None, :], -1)
  return dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages, table=table, lengths=lengths,
              q_pos=q_pos, kv_pos=kv_pos)


class PagedAttentionBase:
  IMPL = "xla"

  def run(self, c, **kw):
    return _paged(c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["table"], impl=self.IMPL,
                  **kw)

  @pytest.mark.parametrize("n,hq,hkv,d", [(1, 4, 4, 64), (3, 8, 2, 128), (4, 8, 1, 64)],
                           ids=["n1_mha", "n3_gqa4_d128", "n4_mqa8"])
  def test_ragged_batch(self, n, hq, hkv, d):
    c = _case(0, [37, 5, 16, 4 + n], n, hq, hkv, d, page_size=16)
    out = self.run(c)
    expected = attention_numpy(c["q"], c["k"], c["v"], c["q_pos"], c["kv_pos"])
    assert out.shape == (4, n, hq, d) and out.dtype == c["q"].dtype
    assert_close(out, expected)

  def test_window(self):
    c = _case(1, [45, 12], 2, 4, 2, 64, page_size=16)
    out = self.run(c, window=6)
    expected = attention_numpy(c["q"], c["k"], c["v"], c["q_pos"], c["kv_pos"], window=6)
    assert_close(out, expected)

  def test_bf16(self):
    c = _case(2, [21, 9], 1, 8, 2, 128, page_size=16, dtype=jnp.bfloat16)
    out = self.run(c, sm_scale=0.1)
    expected = attention_numpy(c["q"], c["k"], c["v"], c["q_pos"], c["kv_pos"], scale=0.1)
    assert out.dtype == jnp.bfloat16
    assert_close(out, expected, jnp.bfloat16)


def _mla_case(seed, lengths, n, h, r, dr, page_size, dtype=jnp.float32):
  lengths = np.asarray(lengths, np.int32)
  b, s = len(lengths), int(lengths.max())
  rng = np.random.default_rng(seed)
  q_lat, q_rope, lat, rope = (rng.standard_normal(shape, dtype=np.float32).astype(dtype)
                              for shape in ((b, n, h, r), (b, n, h, dr), (b, s, r), (b, s, dr)))
  num_pages = b * (-(-s // page_size)) + 2
  lat_pages, table = scatter_to_pages(seed, lat, page_size, num_pages)
  rope_pages, _ = scatter_to_pages(seed, rope, page_size, num_pages)
  # MLA == single-kv-head attention with k = [latent, rope], v = latent.
  q_cat = np.concatenate([q_lat, q_rope], -1)
  k_cat = np.concatenate([lat, rope], -1)[:, :, None]
  q_pos = lengths[:, None] - n + np.arange(n)[None, :]
  kv_pos = np.where(np.arange(s)[None, :] < lengths[:, None], np.arange(s)[None, :], -1)
  return dict(q_lat=q_lat, q_rope=q_rope, lat_pages=lat_pages, rope_pages=rope_pages,
              table=table, lengths=lengths, q_cat=q_cat, k_cat=k_cat,
              v=lat[:, :, None], q_pos=q_pos, kv_pos=kv_pos)


class PagedMlaBase:
  IMPL = "xla"

  def run(self, c, sm_scale):
    return _mla(c["q_lat"], c["q_rope"], c["lat_pages"], c["rope_pages"], c["lengths"], c["table"],
                sm_scale=sm_scale, impl=self.IMPL)

  @pytest.mark.parametrize("n", [1, 2])
  def test_matches_concatenated_attention(self, n):
    c = _mla_case(3, [19, 7, 33], n, 4, 64, 16, page_size=16)
    out = self.run(c, 0.11)
    expected = attention_numpy(c["q_cat"], c["k_cat"], c["v"], c["q_pos"], c["kv_pos"],
                               scale=0.11)
    assert out.shape == (3, n, 4, 64)
    assert_close(out, expected)


class TestPagedAttentionXla(PagedAttentionBase):
  IMPL = "xla"

  def test_auto_resolves_to_xla_on_cpu(self):
    if jax.default_backend() != "cpu":
      pytest.skip("platform-specific resolution")
    c = _case(0, [3], 1, 1, 1, 8, page_size=2)
    jax.eval_shape(paged_attention, c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["table"])
    assert last_impl("paged_attention") == "xla"

  def test_bad_shapes_raise(self):
    c = _case(0, [3, 4], 1, 2, 2, 8, page_size=2)
    with pytest.raises(ValueError, match="page_table"):
      paged_attention(c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["table"][0])
    with pytest.raises(ValueError, match="lengths"):
      paged_attention(c["q"], c["k_pages"], c["v_pages"], c["lengths"][:1], c["table"])


class TestPagedMlaXla(PagedMlaBase):
  IMPL = "xla"


class PagedAttentionPallas(PallasCase, PagedAttentionBase):
  SLOW_IN_INTERPRET = ("test_ragged_batch[n1_mha]",)

  def test_records_path(self):
    c = _case(0, [3], 1, 1, 1, 16, page_size=16)
    jax.eval_shape(functools.partial(paged_attention, impl=self.IMPL), c["q"], c["k_pages"],
                   c["v_pages"], c["lengths"], c["table"])
    assert last_impl("paged_attention") == self.PATH


class TestPagedAttentionPallasTpu(PagedAttentionPallas):
  FORM = "tpu"


class TestPagedAttentionPallasTpuInterpret(TestPagedAttentionPallasTpu):
  INTERPRET = True


class TestPagedAttentionPallasGpu(PagedAttentionPallas):
  FORM = "gpu"


class TestPagedAttentionPallasGpuInterpret(TestPagedAttentionPallasGpu):
  INTERPRET = True


class PagedMlaPallas(PallasCase, PagedMlaBase):
  SLOW_IN_INTERPRET = ("test_matches_concatenated_attention[1]",)


class TestPagedMlaPallasTpu(PagedMlaPallas):
  FORM = "tpu"


class TestPagedMlaPallasTpuInterpret(TestPagedMlaPallasTpu):
  INTERPRET = True


class TestPagedMlaPallasGpu(PagedMlaPallas):
  FORM = "gpu"


class TestPagedMlaPallasGpuInterpret(TestPagedMlaPallasGpu):
  INTERPRET = True


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas_tpu_interpret", "pallas_gpu_interpret"])
@pytest.mark.parametrize("n,hq,hkv", [(1, 8, 8), (2, 8, 2), (4, 8, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_sweep(impl, n, hq, hkv, d, window, dtype):
  _sweep_case(impl, n, hq, hkv, d, window, dtype)


# The sweep reduced for the default suite (issue 12): each interpreted kernel once, multi-
# token queries with GQA / MQA, a window in bf16; the full sweep stays slow.
@pytest.mark.parametrize("impl,n,hq,hkv,d,window,dtype", [
    ("pallas_tpu_interpret", 2, 8, 2, 64, 20, jnp.bfloat16),
    ("pallas_gpu_interpret", 4, 8, 1, 128, None, np.float32)], ids=["tpu-gqa-bf16", "gpu-mqa-f32"])
def test_sweep_reduced(impl, n, hq, hkv, d, window, dtype):
  _sweep_case(impl, n, hq, hkv, d, window, dtype)


def _sweep_case(impl, n, hq, hkv, d, window, dtype):
  c = _case(5, [130, 1 + n, 64, 77, 16], n, hq, hkv, d, page_size=16, dtype=dtype)
  out = _paged(c["q"], c["k_pages"], c["v_pages"], c["lengths"], c["table"], window=window,
               impl=impl)
  expected = attention_numpy(c["q"], c["k"], c["v"], c["q_pos"], c["kv_pos"], window=window)
  assert_close(out, expected, dtype)


@pytest.mark.parametrize("platform,backend", [("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_kernels_lower_for_accelerators(platform, backend):
  from pallas_kernels.paged_attention.kernel import (  # pylint: disable=g-import-not-at-top
      paged_attention_pallas, paged_mla_attention_pallas)
  spec = jax.ShapeDtypeStruct
  b, n, hq, hkv, d, num_pages, ps, max_pages = 4, 2, 16, 2, 128, 64, 16, 8
  i32 = jnp.int32
  lower_for_platform(
      platform,
      lambda q, k, v, l, t: paged_attention_pallas(q, k, v, l, t, window=40, backend=backend),
      spec((b, n, hq, d), jnp.bfloat16), spec((num_pages, ps, hkv, d), jnp.bfloat16),
      spec((num_pages, ps, hkv, d), jnp.bfloat16), spec((b,), i32), spec((b, max_pages), i32))
  lower_for_platform(
      platform,
      lambda ql, qr, lp, rp, l, t: paged_mla_attention_pallas(ql, qr, lp, rp, l, t, sm_scale=0.1,
                                                              backend=backend),
      spec((b, 1, 16, 512), jnp.bfloat16), spec((b, 1, 16, 64), jnp.bfloat16),
      spec((num_pages, ps, 512), jnp.bfloat16), spec((num_pages, ps, 64), jnp.bfloat16),
      spec((b,), i32), spec((b, max_pages), i32))
