"""Gated delta rule: chunk-to-chunk recurrence as a Pallas GPU (Triton) kernel.

Same math as the TPU form (see ``kernel.py``). Triton has no sequential grid
axis, so one program per (batch, head, dv block) loops over the chunks and
keeps its [dk, bv] slice of the state in registers. Splitting dv keeps that
slice small enough not to spill (128 x 32 f32 = 32 registers per thread at
4 warps) and gives the GPU b * h * dv / bv independent programs.

Triton tensor sizes must be powers of two: dk and dv are zero-padded (padded
key channels have zero k, q and W_k rows, so their state rows stay zero;
padded value channels are sliced off), and the chunk size must be a power of
two >= 16 (tl.dot's minimum tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels._common import pad_axis, require


def _pow2(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _gpu_kernel(w_v_ref, w_k_ref, q_dec_ref, p_ref, k_end_ref, decay_ref, s0_ref, o_ref, s_out_ref,
                *, num_chunks):

  def body(ci, s):
    u = w_v_ref[ci] - pc.dot(w_k_ref[ci], s)                       # [C, bv]
    o_ref[ci] = pc.dot(q_dec_ref[ci], s) + pc.dot(p_ref[ci], u)
    return decay_ref[ci][:, None] * s + pc.dot_tn(k_end_ref[ci], u)

  s_out_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s0_ref[...])


def recurrence_gpu(prep, s0, *, interpret, block_v=32):
  """Runs the recurrence; prep as ``reference.chunk_prepare``. Returns (o, S_final)."""
  b, h, n, c, dv = prep["w_v"].shape
  dk = prep["w_k"].shape[-1]
  require(c >= 16 and c & (c - 1) == 0,
          f"GPU gated delta needs a power-of-two chunk_size >= 16, got {c}")
  dkp, dvp = _pow2(dk), _pow2(dv)
  bv = min(block_v, dvp)
  nv = dvp // bv
  w_v = pad_axis(prep["w_v"], 4, dvp)
  w_k, q_dec, k_end = (pad_axis(prep[name], 4, dkp) for name in ("w_k", "q_dec", "k_end"))
  decay = jnp.broadcast_to(prep["decay"], (b, h, n, dk))
  decay = pad_axis(decay, 3, dkp, value=1.0)
  s0 = pad_axis(pad_axis(s0, 2, dkp), 3, dvp)

  def seq_spec(last, v_blocked=False):
    if v_blocked:
      return pc.BlockSpec((None, None, n, c, bv), lambda bi, hi, vi: (bi, hi, 0, 0, vi))
    return pc.BlockSpec((None, None, n, c, last), lambda bi, hi, vi: (bi, hi, 0, 0, 0))

  state_spec = pc.BlockSpec((None, None, dkp, bv), lambda bi, hi, vi: (bi, hi, 0, vi))
  o, s = pc.gpu_call(
      functools.partial(_gpu_kernel, num_chunks=n),
      out_shape=(jax.ShapeDtypeStruct((b, h, n, c, dvp), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, dkp, dvp), jnp.float32)),
      grid=(b, h, nv),
      in_specs=[seq_spec(bv, True), seq_spec(dkp), seq_spec(dkp), seq_spec(c), seq_spec(dkp),
                pc.BlockSpec((None, None, n, dkp), lambda bi, hi, vi: (bi, hi, 0, 0)),
                state_spec],
      out_specs=(seq_spec(bv, True), state_spec),
      num_warps=4,
      num_stages=2,
      interpret=interpret,
      name="gated_delta_recurrence_gpu",
  )(w_v, w_k, q_dec, prep["p"], k_end, decay, s0)
  return o[..., :dv], s[:, :, :dk, :dv]
