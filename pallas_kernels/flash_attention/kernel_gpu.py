"""Flash attention as a Pallas GPU (Triton) kernel.

Triton runs the grid fully in parallel with no scratch that survives between
programs, so the key reduction is an in-kernel loop: one program per
(batch, q head, q tile) walks the key tiles of its kv head, skipping tiles
that no query of the tile can see (decided from per-tile position bounds, as
in the TPU form), and keeps m, l and the accumulator in registers.

Triton tensors must have power-of-two sizes: tiles are powers of two and the
head dims are zero-padded up to one (zero columns change neither q.k nor the
kept part of the output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels._common import cdiv, pad_axis, require
from pallas_kernels.flash_attention.common import (block_bounds, element_mask, finalize,
                                                   online_softmax_update, tile_visible)


def _pow2(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _gpu_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, kmin_ref, kmax_ref, *rest,
                sm_scale, window, bk, nk, has_seg):
  if has_seg:
    qs_ref, ks_ref, o_ref = rest
  else:
    (o_ref,) = rest
  q = q_ref[...]
  qp = qp_ref[...][:, None]
  qs = qs_ref[...][:, None] if has_seg else None
  q_min, q_max = jnp.min(qp), jnp.max(qp)
  bq, dv = o_ref.shape

  def body(ki, carry):
    def compute(c):
      m, l, acc = c
      start = ki * bk
      k = k_ref[pc.ds(start, bk), :]
      s = pc.dot(q, k, trans_b=True) * sm_scale
      kp = kp_ref[pc.ds(start, bk)][None, :]
      ks = ks_ref[pc.ds(start, bk)][None, :] if has_seg else None
      mask = element_mask(qp, kp, window, qs, ks)
      return online_softmax_update(s, mask, m, l, acc, v_ref[pc.ds(start, bk), :])

    run = tile_visible(q_min, q_max, kmin_ref[ki], kmax_ref[ki], window)
    return jax.lax.cond(run, compute, lambda c: c, carry)

  init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, dv), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, nk, body, init)
  o_ref[...] = finalize(acc, l).astype(o_ref.dtype)


def flash_gpu(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, sm_scale, window, block_q, block_k,
              interpret):
  """GPU-form flash attention; arguments as ``kernel.flash_attention_pallas``."""
  b, t, hq, d = q.shape
  s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  grp = hq // hkv
  require(block_q & (block_q - 1) == 0 and block_k & (block_k - 1) == 0,
          f"GPU flash attention needs power-of-two blocks, got {block_q}, {block_k}")
  bq = min(block_q, _pow2(t))
  bk = min(block_k, _pow2(s))
  nq, nk = cdiv(t, bq), cdiv(s, bk)
  t_pad, s_pad = nq * bq, nk * bk
  dp, dvp = _pow2(d), _pow2(dv)

  q_pos = pad_axis(q_pos.astype(jnp.int32), 1, t_pad, value=-1)
  kv_pos = pad_axis(kv_pos.astype(jnp.int32), 1, s_pad, value=-1)
  _, _, kv_min, kv_max = block_bounds(q_pos, kv_pos, bq, bk)
  qx = pad_axis(pad_axis(q, 1, t_pad), 3, dp)
  kx = pad_axis(pad_axis(k, 1, s_pad), 3, dp)
  vx = pad_axis(pad_axis(v, 1, s_pad), 3, dvp)
  has_seg = q_seg is not None

  in_specs = [
      pc.BlockSpec((None, bq, None, dp), lambda bi, hi, qi: (bi, qi, hi, 0)),
      pc.BlockSpec((None, s_pad, None, dp), lambda bi, hi, qi: (bi, 0, hi // grp, 0)),
      pc.BlockSpec((None, s_pad, None, dvp), lambda bi, hi, qi: (bi, 0, hi // grp, 0)),
      pc.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
      pc.BlockSpec((None, s_pad), lambda bi, hi, qi: (bi, 0)),
      pc.BlockSpec((None, nk), lambda bi, hi, qi: (bi, 0)),
      pc.BlockSpec((None, nk), lambda bi, hi, qi: (bi, 0)),
  ]
  operands = [qx, kx, vx, q_pos, kv_pos, kv_min.reshape(b, nk), kv_max.reshape(b, nk)]
  if has_seg:
    in_specs += in_specs[3:5]
    operands += [pad_axis(q_seg.astype(jnp.int32), 1, t_pad, value=-1),
                 pad_axis(kv_seg.astype(jnp.int32), 1, s_pad, value=-2)]
  kernel = functools.partial(_gpu_kernel, sm_scale=sm_scale, window=window, bk=bk, nk=nk,
                             has_seg=has_seg)
  itemsize = q.dtype.itemsize
  out = pc.gpu_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, t_pad, hq, dvp), q.dtype),
      grid=(b, hq, nq),
      in_specs=in_specs,
      out_specs=pc.BlockSpec((None, bq, None, dvp), lambda bi, hi, qi: (bi, qi, hi, 0)),
      num_warps=4 if bq * bk <= 64 * 64 else 8,
      num_stages=2,
      interpret=interpret,
      name="flash_attention_gpu",
      cost_estimate=pc.cost(2 * b * hq * t_pad * s_pad * (dp + dvp), b * hq * t_pad * s_pad,
                            itemsize * (qx.size + (kx.size + vx.size) * nq * grp) +
                            itemsize * b * t_pad * hq * dvp),
  )(*operands)
  return out[:, :t, :, :dv]
