"""Grouped matmul in pure JAX: the naive reference and the tiled XLA form.

Semantics (those of ``jax.lax.ragged_dot``): ``lhs`` [m, k] holds the rows of
``g`` groups back to back, group ``e`` owning rows
``[sum(sizes[:e]), sum(sizes[:e+1]))``; each row is multiplied by its group's
weight ``rhs[e]`` [k, n]. Rows past ``sum(sizes)`` belong to no group and give
zeros. Empty groups are allowed.

The XLA form (``grouped_matmul_xla``) loops over the non-empty groups and
cuts each group's rows into power-of-two blocks starting at the group's
first row; the Pallas kernels walk "visits": (group, row tile) pairs whose
rows intersect, a tile straddling a group boundary being visited once per
group it touches, each visit writing only its group's rows. Either way the
work is that of the rows actually present (plus rounding): no per-expert
capacity, nothing dropped, and nothing proportional to ``g * m``
(``jax.lax.ragged_dot`` on CPU expands ``lhs`` to [g, m, k] and costs as
much as evaluating every group on every row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, cdiv, pad_axis, require, shape_str


def check_inputs(lhs, rhs, group_sizes):
  """Validates shapes; returns (m, k, n, g)."""
  require(lhs.ndim == 2 and rhs.ndim == 3 and group_sizes.ndim == 1,
          f"grouped_matmul needs lhs [m, k], rhs [g, k, n], group_sizes [g]; got "
          f"{shape_str(lhs=lhs, rhs=rhs, group_sizes=group_sizes)}")
  m, k = lhs.shape
  g, k2, n = rhs.shape
  require(k == k2, f"grouped_matmul contraction mismatch: {shape_str(lhs=lhs, rhs=rhs)}")
  require(group_sizes.shape[0] == g,
          f"group_sizes must have one entry per group: {shape_str(rhs=rhs, group_sizes=group_sizes)}")
  require(jnp.issubdtype(group_sizes.dtype, jnp.integer), "group_sizes must be integers")
  return m, k, n, g


def group_bounds(group_sizes):
  """(starts, ends) int32 [g]: the row range of each group."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return ends - group_sizes.astype(jnp.int32), ends


def row_groups(group_sizes, m):
  """Group of every row, int32 [m]; rows past the last group get ``g`` (none)."""
  _, ends = group_bounds(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_matmul_reference(lhs, rhs, group_sizes, *, out_dtype=None):
  """Row by row: ``out[i] = lhs[i] @ rhs[group(i)]`` (f32 accumulation, HIGHEST).

  Gathers one [k, n] weight per row, so it is for tests, not for speed.
  """
  m, _, _, g = check_inputs(lhs, rhs, group_sizes)
  out_dtype = out_dtype or lhs.dtype
  grp = row_groups(group_sizes, m)
  w = jnp.take(rhs, jnp.minimum(grp, g - 1), axis=0)                  # [m, k, n]
  out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w.astype(jnp.float32),
                   precision=HIGHEST)
  return jnp.where((grp < g)[:, None], out, 0.0).astype(out_dtype)


def visit_metadata(group_sizes, m, tile):
  """The (group, row tile) visits of the tiled form.

  Args:
    group_sizes: int [g], summing to at most m.
    m: rows of lhs (static).
    tile: rows per tile (static).

  Returns:
    (visit_group int32 [V], visit_tile int32 [V], n_visits int32 scalar) with
    ``V = cdiv(m, tile) + g - 1`` (the most visits any group sizes can need).
    Visits are ordered by row, so a tile's visits are consecutive; entries
    past ``n_visits`` repeat the last valid visit (harmless to recompute).
  """
  g = group_sizes.shape[0]
  num_visits = cdiv(m, tile) + g - 1
  sizes = group_sizes.astype(jnp.int32)
  starts, ends = group_bounds(sizes)
  first = starts // tile
  last = jnp.maximum(ends - 1, 0) // tile
  per_group = jnp.where(sizes > 0, last - first + 1, 0)
  visit_end = jnp.cumsum(per_group)
  n_visits = visit_end[-1]
  v = jnp.minimum(jnp.arange(num_visits, dtype=jnp.int32), jnp.maximum(n_visits - 1, 0))
  grp = jnp.minimum(jnp.searchsorted(visit_end, v, side="right"), g - 1).astype(jnp.int32)
  tile_of = first[grp] + v - (visit_end[grp] - per_group[grp])
  return grp, tile_of.astype(jnp.int32), n_visits


def default_tile(m: int, g: int) -> int:
  """Rows per tile of the Pallas kernels: about the mean group size
  (8 <= tile <= 128, a power of two). Larger tiles waste rows where a tile
  straddles groups; smaller ones pay more grid steps and weight reads."""
  mean = max(1, m // max(g, 1))
  return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def segment_sizes(max_rows: int) -> tuple[int, ...]:
  """The static block heights of the XLA form: max_rows, max_rows/2, ..., 8."""
  sizes, s = [], max(8, 1 << (max(max_rows, 8) - 1).bit_length())
  while s >= 8:
    sizes.append(s)
    s //= 2
  return tuple(sizes)


def grouped_matmul_xla(lhs, rhs, group_sizes, *, tile=None, out_dtype=None):
  """Group by group, each group's rows cut into power-of-two blocks (XLA loops).

  An outer loop visits only the non-empty groups (so a decode step with a
  few rows reads only the weights it uses); for each, its rows are covered
  by ``size // T`` blocks of the largest height ``T`` (``tile``, default 128)
  and then at most one block of each smaller height T/2, ..., 8, following
  the binary digits of the remainder, the last one masked. Blocks start at
  the group's own first row, never straddle a group except in that masked
  last block, and waste fewer than 8 rows per group: the work is that of the
  rows present, in matmuls as tall as the groups allow.
  """
  m, k, n, g = check_inputs(lhs, rhs, group_sizes)
  out_dtype = out_dtype or lhs.dtype
  heights = segment_sizes(tile or 128)
  pad = heights[0]
  x = pad_axis(lhs, 0, m + pad)
  sizes = group_sizes.astype(jnp.int32)
  starts, _ = group_bounds(sizes)
  # Non-empty groups first (stable, so in order); loop over only those.
  nonempty = jnp.argsort(sizes == 0, stable=True).astype(jnp.int32)
  n_nonempty = jnp.sum(sizes > 0)

  def block(out, w, row, height, valid):
    y = jnp.dot(jax.lax.dynamic_slice(x, (row, 0), (height, k)), w,
                preferred_element_type=jnp.float32).astype(out_dtype)
    if valid is not None:  # the last, partial block: keep the next group's rows
      current = jax.lax.dynamic_slice(out, (row, 0), (height, n))
      y = jnp.where((jnp.arange(height) < valid)[:, None], y, current)
    return jax.lax.dynamic_update_slice(out, y, (row, 0))

  def group_body(i, out):
    e = nonempty[i]
    w, row, left = rhs[e], starts[e], sizes[e]
    top = heights[0]
    out, row = jax.lax.fori_loop(
        0, left // top, lambda _, c: (block(c[0], w, c[1], top, None), c[1] + top), (out, row))
    left = left % top
    for h in heights[1:]:
      take = left >= h
      out = jax.lax.cond(take, lambda o, r=row, h=h: block(o, w, r, h, None), lambda o: o, out)
      row, left = row + jnp.where(take, h, 0), left - jnp.where(take, h, 0)
    return jax.lax.cond(left > 0, lambda o: block(o, w, row, 8, left), lambda o: o, out)

  out = jax.lax.fori_loop(0, n_nonempty, group_body, jnp.zeros((m + pad, n), out_dtype))
  return out[:m]
