"""Flash attention as a Pallas TPU kernel (BlockSpec grid, online softmax).

Grid (batch, kv_head, q_block, kv_block); the kv_block axis is the sequential
reduction ("arbitrary") and carries the softmax statistics m, l and the output
accumulator in VMEM scratch. All q heads of one kv head (the GQA group) are
processed together, so every K/V tile is fetched once per group instead of
once per q head.

Visibility is decided from positions (not indices), so which tiles can be
skipped is data: per-tile min/max positions are computed in XLA and prefetched
into SMEM, and a tile whose keys are all in the future of (or outside the
window of) every query in the q tile skips its matmuls. The exact per-element
mask is still applied inside visited tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels import _dispatch
from pallas_kernels._common import cdiv, pad_axis, require
from pallas_kernels.flash_attention import kernel_gpu
from pallas_kernels.flash_attention.common import (block_bounds, element_mask, finalize,
                                                   online_softmax_update, tile_visible)
from pallas_kernels.flash_attention.reference import check_inputs

def _tpu_kernel(qmin_ref, qmax_ref, kmin_ref, kmax_ref,  # SMEM scalar prefetch
                q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest,
                sm_scale, window, grp, bq, nq, nk, has_seg):
  if has_seg:
    qs_ref, ks_ref, o_ref, m_sc, l_sc, acc_sc = rest
  else:
    o_ref, m_sc, l_sc, acc_sc = rest
  bi, qi, ki = pc.program_id(0), pc.program_id(2), pc.program_id(3)

  @pc.when(ki == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  run = tile_visible(qmin_ref[bi * nq + qi], qmax_ref[bi * nq + qi],
                     kmin_ref[bi * nk + ki], kmax_ref[bi * nk + ki], window)

  @pc.when(run)
  def _compute():
    d = q_ref.shape[-1]
    q = q_ref[...].reshape(grp * bq, d)
    s = pc.dot(q, k_ref[...], trans_b=True) * sm_scale                 # [grp*bq, bk]
    mask = element_mask(qp_ref[...], kp_ref[...], window,
                        qs_ref[...] if has_seg else None, ks_ref[...] if has_seg else None)
    if grp > 1:
      mask = jnp.concatenate([mask] * grp, axis=0)                      # rows are (head, query)
    m, l, acc = online_softmax_update(s, mask, m_sc[...], l_sc[...], acc_sc[...], v_ref[...])
    m_sc[...] = m
    l_sc[...] = l
    acc_sc[...] = acc

  @pc.when(ki == nk - 1)
  def _store():
    out = finalize(acc_sc[...], l_sc[...])
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def _flash_tpu(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, sm_scale, window, block_q, block_k,
               interpret):
  b, t, hq, d = q.shape
  s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  grp = hq // hkv
  if not interpret:
    # Mosaic tiling: sublane tiles of 8 rows, lane tiles of 128 columns (the
    # key positions are laid out along lanes).
    require(block_q % 8 == 0 and block_k % 128 == 0,
            f"TPU flash attention needs block_q % 8 == 0 and block_k % 128 == 0, "
            f"got {block_q}, {block_k}")
  bq = min(block_q, cdiv(t, 8) * 8)
  bk = min(block_k, cdiv(s, 128) * 128) if not interpret else min(block_k, s)
  nq, nk = cdiv(t, bq), cdiv(s, bk)
  t_pad, s_pad = nq * bq, nk * bk

  q_pos = pad_axis(q_pos.astype(jnp.int32), 1, t_pad, value=-1)
  kv_pos = pad_axis(kv_pos.astype(jnp.int32), 1, s_pad, value=-1)
  bounds = block_bounds(q_pos, kv_pos, bq, bk)
  qt = jnp.transpose(pad_axis(q, 1, t_pad).reshape(b, t_pad, hkv, grp, d), (0, 2, 3, 1, 4))
  kt = jnp.transpose(pad_axis(k, 1, s_pad), (0, 2, 1, 3))                # [b, hkv, s, d]
  vt = jnp.transpose(pad_axis(v, 1, s_pad), (0, 2, 1, 3))
  has_seg = q_seg is not None

  in_specs = [
      pc.BlockSpec((None, None, grp, bq, d), lambda bi, hi, qi, ki, *_: (bi, hi, 0, qi, 0)),
      pc.BlockSpec((None, None, bk, d), lambda bi, hi, qi, ki, *_: (bi, hi, ki, 0)),
      pc.BlockSpec((None, None, bk, dv), lambda bi, hi, qi, ki, *_: (bi, hi, ki, 0)),
      pc.BlockSpec((None, bq, 1), lambda bi, hi, qi, ki, *_: (bi, qi, 0)),
      pc.BlockSpec((None, 1, bk), lambda bi, hi, qi, ki, *_: (bi, 0, ki)),
  ]
  operands = [qt, kt, vt, q_pos[:, :, None], kv_pos[:, None, :]]
  if has_seg:
    in_specs += in_specs[-2:]
    operands += [pad_axis(q_seg.astype(jnp.int32), 1, t_pad, value=-1)[:, :, None],
                 pad_axis(kv_seg.astype(jnp.int32), 1, s_pad, value=-2)[:, None, :]]
  kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, window=window, grp=grp, bq=bq,
                             nq=nq, nk=nk, has_seg=has_seg)
  itemsize = q.dtype.itemsize
  out = pc.tpu_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, hkv, grp, t_pad, dv), q.dtype),
      grid=(b, hkv, nq, nk),
      in_specs=in_specs,
      out_specs=pc.BlockSpec((None, None, grp, bq, dv),
                             lambda bi, hi, qi, ki, *_: (bi, hi, 0, qi, 0)),
      scratch_shapes=[pc.vmem((grp * bq, 1), jnp.float32), pc.vmem((grp * bq, 1), jnp.float32),
                      pc.vmem((grp * bq, dv), jnp.float32)],
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      num_scalar_prefetch=4,
      interpret=interpret,
      name="flash_attention_tpu",
      cost_estimate=pc.cost(2 * b * hq * t_pad * s_pad * (d + dv), b * hq * t_pad * s_pad,
                            itemsize * (q.size + k.size * nq + v.size * nq) + itemsize * b * t * hq * dv),
  )(*bounds, *operands)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t_pad, hq, dv)
  return out[:, :t]


def flash_attention_pallas(q, k, v, *, q_positions, kv_positions, window=None,
                           q_segment_ids=None, kv_segment_ids=None, sm_scale=None,
                           block_q=128, block_k=128, backend="pallas_tpu"):
  """Runs the TPU- or GPU-form kernel; arguments as ``ops.flash_attention``.

  ``backend`` is a resolved Pallas path from ``_dispatch.resolve_impl``.
  """
  check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  require(block_q >= 1 and block_k >= 1, f"block sizes must be positive, got {block_q}, {block_k}")
  form, interpret = _dispatch.kernel_form(backend)
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
  args = (q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
  kw = dict(sm_scale=sm_scale, window=window, block_q=block_q, block_k=block_k,
            interpret=interpret)
  if form == pc.TPU:
    return _flash_tpu(*args, **kw)
  return kernel_gpu.flash_gpu(*args, **kw)
