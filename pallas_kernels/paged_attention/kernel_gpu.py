"""Paged decode attention as a Pallas GPU (Triton) kernel.

One program per (sequence, kv head) walks the pages its queries can see
(a loop with data-dependent bounds read from ``lengths``), looks each physical
page up in the page table and loads it straight from the page pool: no gather
of the cache into a contiguous copy. The query rows are the GQA group times
the n new tokens, padded to a power of two (Triton tensor sizes must be).

The page pool is passed whole (it can be far larger than what one sequence
uses) and indexed with the page id; head dims and the page size must already
be powers of two (padding the pool would copy the whole cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels._common import pad_axis, require
from pallas_kernels.flash_attention.common import element_mask, finalize, online_softmax_update
from pallas_kernels.paged_attention.common import page_range, query_rows


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _pow2(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _gpu_kernel(len_ref, table_ref, qpos_ref, q_ref, *rest, sm_scale, window, n, page_size, mla):
  if mla:
    qr_ref, k_ref, kr_ref, o_ref = rest
  else:
    k_ref, v_ref, o_ref = rest
  bi, hi = pc.program_id(0), pc.program_id(1)
  length = len_ref[bi]
  first, last = page_range(length, n, page_size, window)
  q = q_ref[...]
  qr = qr_ref[...] if mla else None
  qpos = qpos_ref[...][:, None]
  rows, dv = o_ref.shape

  def body(slot, carry):
    m, l, acc = carry
    page = table_ref[slot]
    kpos = slot * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]
    kpos = jnp.where(kpos < length, kpos, -1)
    mask = element_mask(qpos, kpos, window)
    if mla:
      lat = k_ref[page, :, :]
      s = pc.dot(q, lat, trans_b=True) + pc.dot(qr, kr_ref[page, :, :], trans_b=True)
      val = lat
    else:
      s = pc.dot(q, k_ref[page, :, hi, :], trans_b=True)
      val = v_ref[page, :, hi, :]
    return online_softmax_update(s * sm_scale, mask, m, l, acc, val)

  init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, dv), jnp.float32))
  _, l, acc = jax.lax.fori_loop(first, last + 1, body, init)
  o_ref[...] = finalize(acc, l).astype(o_ref.dtype)


def _launch(q_rows, q2_rows, k_pages, k2_pages, v_pages, lengths, page_table, qpos, *, sm_scale,
            window, n, heads, mla, out_dtype, interpret):
  """q_rows [b, heads, rows, d]; returns [b, heads, rows, dv]."""
  b, _, rows, _ = q_rows.shape
  page_size = k_pages.shape[1]
  dv = (k_pages if mla else v_pages).shape[-1]
  for name, x in (("page_size", page_size), ("head_dim", q_rows.shape[-1]), ("dv", dv)):
    require(_is_pow2(x), f"GPU paged attention needs a power-of-two {name}, got {x}")
  if not interpret:
    require(page_size >= 16, f"GPU paged attention needs page_size >= 16 (tl.dot), got {page_size}")
  rows_p = _pow2(rows)
  q_rows = pad_axis(q_rows, 2, rows_p)
  q2_rows = pad_axis(q2_rows, 2, rows_p) if mla else None
  qpos = pad_axis(qpos[..., 0], 1, rows_p, value=-1)  # padded rows see nothing

  def whole(x):
    return pc.BlockSpec(x.shape, lambda bi, hi: (0,) * x.ndim)

  def per_seq_head(x):
    return pc.BlockSpec((None, None, *x.shape[2:]), lambda bi, hi: (bi, hi, 0, 0))

  operands = [lengths, page_table, qpos, q_rows]
  in_specs = [whole(lengths), pc.BlockSpec((None, page_table.shape[1]), lambda bi, hi: (bi, 0)),
              pc.BlockSpec((None, rows_p), lambda bi, hi: (bi, 0)), per_seq_head(q_rows)]
  if mla:
    operands += [q2_rows, k_pages, k2_pages]
    in_specs += [per_seq_head(q2_rows), whole(k_pages), whole(k2_pages)]
  else:
    operands += [k_pages, v_pages]
    in_specs += [whole(k_pages), whole(v_pages)]
  kernel = functools.partial(_gpu_kernel, sm_scale=sm_scale, window=window, n=n,
                             page_size=page_size, mla=mla)
  out = pc.gpu_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, heads, rows_p, dv), out_dtype),
      grid=(b, heads),
      in_specs=in_specs,
      out_specs=pc.BlockSpec((None, None, rows_p, dv), lambda bi, hi: (bi, hi, 0, 0)),
      num_warps=4,
      num_stages=2,
      interpret=interpret,
      name="paged_mla_attention_gpu" if mla else "paged_attention_gpu",
  )(*operands)
  return out[:, :, :rows]


def paged_gpu(q, k_pages, v_pages, lengths, page_table, *, sm_scale, window, interpret):
  """GPU-form paged attention; q [b, n, hq, d] -> [b, n, hq, dv]."""
  b, n, hq, d = q.shape
  num_pages, _, hkv, dv = v_pages.shape
  grp = hq // hkv
  page_table = jnp.clip(page_table, 0, num_pages - 1)
  q_rows = jnp.transpose(q.reshape(b, n, hkv, grp, d), (0, 2, 3, 1, 4)).reshape(b, hkv, grp * n, d)
  out = _launch(q_rows, None, k_pages, None, v_pages, lengths, page_table,
                query_rows(lengths, n, grp), sm_scale=sm_scale, window=window, n=n, heads=hkv,
                mla=False, out_dtype=q.dtype, interpret=interpret)
  out = out.reshape(b, hkv, grp, n, dv)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, hq, dv)


def paged_mla_gpu(q_latent, q_rope, latent_pages, rope_pages, lengths, page_table, *, sm_scale,
                  interpret):
  """GPU-form absorbed MLA; q_latent [b, n, h, r] -> [b, n, h, r]."""
  b, n, h, r = q_latent.shape
  page_table = jnp.clip(page_table, 0, latent_pages.shape[0] - 1)

  def rows(x):
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(b, 1, h * n, x.shape[-1])

  out = _launch(rows(q_latent), rows(q_rope), latent_pages, rope_pages, None, lengths, page_table,
                query_rows(lengths, n, h), sm_scale=sm_scale, window=None, n=n, heads=1,
                mla=True, out_dtype=q_latent.dtype, interpret=interpret)
  return jnp.transpose(out.reshape(b, h, n, r), (0, 2, 1, 3))
