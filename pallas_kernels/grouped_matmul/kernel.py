"""Grouped matmul as Pallas kernels (TPU form and GPU/Triton form).

TPU form: grid (n blocks, visits). The visit list of ``reference.visit_metadata``
(group, row tile) is scalar-prefetched into SMEM, so the BlockSpec index maps
DMA exactly the row tile and the group weight each visit needs. A tile's
visits are consecutive, so its output block stays resident across them and
each visit selects only its own group's rows into it; the visit axis is
sequential ("arbitrary"), the n axis parallel. Steps past the real visit
count repeat the last visit's block indices (no new DMA) and skip the compute.

GPU form: Triton has no sequential grid axis, so one program per (row tile,
n block) loops over the groups its rows intersect (a contiguous range, since
rows are sorted by group) and selects each group's rows of ``x @ w[e]``.
Triton needs power-of-two tensor sizes: k and n are zero-padded to powers of
two and the tile is a power of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels import _dispatch
from pallas_kernels._common import cdiv, pad_axis, require
from pallas_kernels.grouped_matmul import reference


def _pow2(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _tpu_kernel(vg_ref, vt_ref, start_ref, end_ref, nv_ref, x_ref, w_ref, o_ref, *, tile):
  v = pc.program_id(1)
  e, t = vg_ref[v], vt_ref[v]

  @pc.when(jnp.logical_or(v == 0, vt_ref[jnp.maximum(v - 1, 0)] != t))
  def _init():  # first visit of this row tile
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

  @pc.when(v < nv_ref[0])
  def _compute():
    y = pc.dot(x_ref[...], w_ref[...])
    rows = t * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
    mine = jnp.logical_and(rows >= start_ref[e], rows < end_ref[e])
    o_ref[...] = jnp.where(mine, y.astype(o_ref.dtype), o_ref[...])


def _gmm_tpu(lhs, rhs, group_sizes, *, tile, block_n, out_dtype, interpret):
  m, k = lhs.shape
  g, _, n = rhs.shape
  if not interpret:
    require(tile % 8 == 0 and (n % 128 == 0 or n == block_n),
            f"TPU grouped matmul needs tile % 8 == 0 and n % 128 == 0, got tile={tile}, n={n}")
  bn = min(block_n, n) if n % min(block_n, n) == 0 else n
  mp = cdiv(m, tile) * tile
  x = pad_axis(lhs, 0, mp)
  vg, vt, nv = reference.visit_metadata(group_sizes, m, tile)
  starts, ends = reference.group_bounds(group_sizes)
  num_visits = vg.shape[0]
  kernel = functools.partial(_tpu_kernel, tile=tile)
  out = pc.tpu_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
      grid=(n // bn, num_visits),
      in_specs=[pc.BlockSpec((tile, k), lambda ni, v, vg, vt, *_: (vt[v], 0)),
                pc.BlockSpec((None, k, bn), lambda ni, v, vg, vt, *_: (vg[v], 0, ni))],
      out_specs=pc.BlockSpec((tile, bn), lambda ni, v, vg, vt, *_: (vt[v], ni)),
      dimension_semantics=("parallel", "arbitrary"),
      num_scalar_prefetch=5,
      interpret=interpret,
      name="grouped_matmul_tpu",
      cost_estimate=pc.cost(2 * mp * k * n, 0, lhs.dtype.itemsize * mp * k
                            + rhs.dtype.itemsize * g * k * n + jnp.dtype(out_dtype).itemsize * mp * n),
  )(vg, vt, starts, ends, nv.reshape(1), x, rhs)
  return out[:m]


def _gpu_kernel(first_ref, last_ref, start_ref, end_ref, x_ref, w_ref, o_ref, *, tile):
  t = pc.program_id(0)
  x = x_ref[...]
  rows = t * tile + jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0)

  def body(e, acc):
    y = pc.dot(x, w_ref[e])
    mine = jnp.logical_and(rows >= start_ref[e], rows < end_ref[e])
    return jnp.where(mine, y, acc)

  acc = jax.lax.fori_loop(first_ref[t], last_ref[t] + 1, body,
                          jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _gmm_gpu(lhs, rhs, group_sizes, *, tile, block_n, out_dtype, interpret):
  m, k = lhs.shape
  g, _, n = rhs.shape
  tile = _pow2(tile)
  kp, np2 = _pow2(k), _pow2(n)
  bn = min(_pow2(block_n), np2)
  num_tiles = cdiv(m, tile)
  mp = num_tiles * tile
  x = pad_axis(pad_axis(lhs, 0, mp), 1, kp)
  w = pad_axis(pad_axis(rhs, 1, kp), 2, np2)
  starts, ends = reference.group_bounds(group_sizes)
  grp = reference.row_groups(group_sizes, mp)
  tile_rows = jnp.arange(num_tiles, dtype=jnp.int32) * tile
  first = jnp.minimum(grp[tile_rows], g - 1)
  # Tiles past the last row of any group get an empty range (last < first).
  last = jnp.where(grp[tile_rows] < g, jnp.minimum(grp[tile_rows + tile - 1], g - 1), first - 1)

  def full(size):
    return pc.BlockSpec((size,), lambda ti, ni: (0,))

  out = pc.gpu_call(
      functools.partial(_gpu_kernel, tile=tile),
      out_shape=jax.ShapeDtypeStruct((mp, np2), out_dtype),
      grid=(num_tiles, np2 // bn),
      in_specs=[full(num_tiles), full(num_tiles), full(g), full(g),
                pc.BlockSpec((tile, kp), lambda ti, ni: (ti, 0)),
                pc.BlockSpec((g, kp, bn), lambda ti, ni: (0, 0, ni))],
      out_specs=pc.BlockSpec((tile, bn), lambda ti, ni: (ti, ni)),
      num_warps=4,
      num_stages=2,
      interpret=interpret,
      name="grouped_matmul_gpu",
  )(first, last, starts, ends, x, w)
  return out[:m, :n]


def grouped_matmul_pallas(lhs, rhs, group_sizes, *, tile=None, out_dtype=None,
                          block_n=128, backend="pallas_tpu"):
  """Pallas grouped matmul; arguments as ``ops.grouped_matmul``."""
  m, _, _, g = reference.check_inputs(lhs, rhs, group_sizes)
  form, interpret = _dispatch.kernel_form(backend)
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  tile = tile or reference.default_tile(m, g)
  group_sizes = group_sizes.astype(jnp.int32)
  if form == pc.GPU:
    out = _gmm_gpu(lhs, rhs, group_sizes, tile=tile, block_n=block_n, out_dtype=out_dtype,
                   interpret=interpret)
  else:
    out = _gmm_tpu(lhs, rhs, group_sizes, tile=tile, block_n=block_n, out_dtype=out_dtype,
                   interpret=interpret)
  # Rows past the last group are never visited; they are zeros by definition.
  total = jnp.sum(group_sizes)
  return jnp.where((jnp.arange(m) < total)[:, None], out, jnp.zeros((), out_dtype))
