"""Paged decode attention as a Pallas TPU kernel.

Grid (batch, page_slot); the page axis is the sequential reduction. The page
table and lengths are scalar-prefetched into SMEM so the K/V BlockSpec index
maps can look up the physical page of each slot: the pipeline DMAs exactly the
pages a sequence owns, in table order, whatever their physical placement.
Slots past a sequence's last page (or before the first page its window can
see) map to the same page as their neighbour, which the pipeline does not
re-fetch, and skip their compute.

One grid step reads one page for all kv heads ([page_size, hkv * d], a free
reshape of the page pool), so each page is read from HBM exactly once; the
query rows of a kv head are its whole GQA group times the n new tokens.

The MLA variant is the same kernel with one kv head whose key is
[latent, rope] and whose value is the latent itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels import _dispatch
from pallas_kernels._common import require
from pallas_kernels.flash_attention.common import element_mask, finalize, online_softmax_update
from pallas_kernels.paged_attention import kernel_gpu
from pallas_kernels.paged_attention.common import page_range, query_rows
from pallas_kernels.paged_attention.reference import check_mla_inputs, check_paged_inputs


def _tpu_kernel(len_ref, table_ref, qpos_ref, q_ref, *rest, sm_scale, window, n, page_size,
                num_slots, heads, d, dv, mla):
  del table_ref  # only the index maps read it
  if mla:
    qr_ref, k_ref, kr_ref, o_ref, m_sc, l_sc, acc_sc = rest
  else:
    k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc = rest
  bi, pi = pc.program_id(0), pc.program_id(1)
  length = len_ref[bi]
  first, last = page_range(length, n, page_size, window)

  @pc.when(pi == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pc.when(jnp.logical_and(pi >= first, pi <= last))
  def _compute():
    kpos = pi * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    kpos = jnp.where(kpos < length, kpos, -1)
    mask = element_mask(qpos_ref[...], kpos, window)
    for h in range(heads):  # static: kv heads share the page DMA
      if mla:
        lat = k_ref[...]
        s = pc.dot(q_ref[h], lat, trans_b=True) + pc.dot(qr_ref[h], kr_ref[...], trans_b=True)
        val = lat
      else:
        s = pc.dot(q_ref[h], k_ref[:, h * d:(h + 1) * d], trans_b=True)
        val = v_ref[:, h * dv:(h + 1) * dv]
      m, l, acc = online_softmax_update(s * sm_scale, mask, m_sc[h], l_sc[h], acc_sc[h], val)
      m_sc[h] = m
      l_sc[h] = l
      acc_sc[h] = acc

  @pc.when(pi == num_slots - 1)
  def _store():
    o_ref[...] = finalize(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _page_index_map(n, page_size, window, num_slots):
  def index_map(bi, pi, len_ref, table_ref):
    first, last = page_range(len_ref[bi], n, page_size, window)
    slot = jnp.clip(pi, first, jnp.maximum(last, first))
    return table_ref[bi * num_slots + slot], 0, 0
  return index_map


def _paged_tpu(q_rows, q2_rows, k_flat, k2_flat, v_flat, lengths, page_table, qpos, *, sm_scale,
               window, n, heads, d, dv, mla, out_dtype, interpret):
  """Shared launcher; q_rows [b, heads, rows, d], pages flattened to [P, ps, cols]."""
  b, _, rows, _ = q_rows.shape
  page_size = k_flat.shape[1]
  num_slots = page_table.shape[1]
  page_map = _page_index_map(n, page_size, window, num_slots)

  def page_spec(x):
    return pc.BlockSpec((None, page_size, x.shape[2]), page_map)

  def per_seq(x):
    return pc.BlockSpec((None, *x.shape[1:]), lambda bi, pi, *_: (bi,) + (0,) * (x.ndim - 1))

  operands = [qpos, q_rows] + ([q2_rows, k_flat, k2_flat] if mla else [k_flat, v_flat])
  in_specs = [per_seq(qpos), per_seq(q_rows)]
  in_specs += ([per_seq(q2_rows), page_spec(k_flat), page_spec(k2_flat)] if mla
               else [page_spec(k_flat), page_spec(v_flat)])
  kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, window=window, n=n,
                             page_size=page_size, num_slots=num_slots, heads=heads, d=d, dv=dv,
                             mla=mla)
  kv_bytes = sum(x.dtype.itemsize * b * num_slots * page_size * x.shape[2]
                 for x in ([k_flat, k2_flat] if mla else [k_flat, v_flat]))
  return pc.tpu_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, heads, rows, dv), out_dtype),
      grid=(b, num_slots),
      in_specs=in_specs,
      out_specs=pc.BlockSpec((None, heads, rows, dv), lambda bi, pi, *_: (bi, 0, 0, 0)),
      scratch_shapes=[pc.vmem((heads, rows, 1), jnp.float32),
                      pc.vmem((heads, rows, 1), jnp.float32),
                      pc.vmem((heads, rows, dv), jnp.float32)],
      dimension_semantics=("parallel", "arbitrary"),
      num_scalar_prefetch=2,
      interpret=interpret,
      name="paged_mla_attention_tpu" if mla else "paged_attention_tpu",
      cost_estimate=pc.cost(2 * b * heads * rows * num_slots * page_size * (d + dv),
                            b * heads * rows * num_slots * page_size, kv_bytes),
  )(lengths.astype(jnp.int32), page_table.reshape(-1).astype(jnp.int32), *operands)


def paged_attention_pallas(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                           window=None, backend="pallas_tpu"):
  """Pallas paged attention; arguments as ``ops.paged_attention``."""
  b, n, hq, d, num_pages, ps, hkv, dv, _ = check_paged_inputs(q, k_pages, v_pages, lengths,
                                                              page_table)
  form, interpret = _dispatch.kernel_form(backend)
  sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
  grp = hq // hkv
  lengths = lengths.astype(jnp.int32)
  # Unused table slots may hold junk; a clamped id keeps every DMA in bounds.
  page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
  if form == pc.GPU:
    return kernel_gpu.paged_gpu(q, k_pages, v_pages, lengths, page_table, sm_scale=sm_scale,
                                window=window, interpret=interpret)
  if not interpret:
    require(ps % 8 == 0, f"TPU paged attention needs page_size % 8 == 0, got {ps}")
  # Rows of kv head h: its grp q heads x n tokens, head-major.
  q_rows = jnp.transpose(q.reshape(b, n, hkv, grp, d), (0, 2, 3, 1, 4)).reshape(b, hkv, grp * n, d)
  out = _paged_tpu(q_rows, None, k_pages.reshape(num_pages, ps, hkv * d), None,
                   v_pages.reshape(num_pages, ps, hkv * dv), lengths, page_table,
                   query_rows(lengths, n, grp), sm_scale=sm_scale, window=window, n=n,
                   heads=hkv, d=d, dv=dv, mla=False, out_dtype=q.dtype, interpret=interpret)
  out = out.reshape(b, hkv, grp, n, dv)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, hq, dv)


def paged_mla_attention_pallas(q_latent, q_rope, latent_pages, rope_pages, lengths, page_table, *,
                               sm_scale, backend="pallas_tpu"):
  """Pallas absorbed-MLA paged attention; arguments as ``ops.paged_mla_attention``."""
  b, n, h, r, _, num_pages, ps, _ = check_mla_inputs(q_latent, q_rope, latent_pages, rope_pages,
                                                     lengths, page_table)
  form, interpret = _dispatch.kernel_form(backend)
  lengths = lengths.astype(jnp.int32)
  page_table = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
  if form == pc.GPU:
    return kernel_gpu.paged_mla_gpu(q_latent, q_rope, latent_pages, rope_pages, lengths,
                                    page_table, sm_scale=float(sm_scale), interpret=interpret)
  if not interpret:
    require(ps % 8 == 0, f"TPU paged attention needs page_size % 8 == 0, got {ps}")

  def rows(x):  # [b, n, h, c] -> [b, 1, h*n, c], head-major like query_rows
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(b, 1, h * n, x.shape[-1])

  out = _paged_tpu(rows(q_latent), rows(q_rope), latent_pages, rope_pages, None, lengths,
                   page_table, query_rows(lengths, n, h), sm_scale=float(sm_scale), window=None,
                   n=n, heads=1, d=r, dv=r, mla=True, out_dtype=q_latent.dtype,
                   interpret=interpret)
  return jnp.transpose(out.reshape(b, h, n, r), (0, 2, 1, 3))
