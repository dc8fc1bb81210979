"""Mamba2 SSD as one fused Pallas GPU (Triton) kernel.

Same per-chunk math as the TPU form (``kernel.chunk_step``). Triton has no
sequential grid axis, so one program per (batch, head, head_dim block) loops
over the chunks with its [bp, n] state slice in registers.

Triton tensor sizes must be powers of two: head_dim and the state size are
zero-padded (zero x columns and zero B/C columns add nothing and are sliced
off), and the chunk size must be a power of two >= 16 (tl.dot's minimum tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels._common import pad_axis, require
from pallas_kernels.ssd.common import chunk_step


def _pow2(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _gpu_kernel(x_ref, dt_ref, lc_ref, b_ref, c_ref, s0_ref, y_ref, s_out_ref, *, num_chunks,
                chunk):

  def body(ci, s):
    lc = lc_ref[ci]
    l_last = jnp.full((1, 1), lc_ref[ci, chunk - 1], jnp.float32)
    y, s = chunk_step(x_ref[ci].astype(jnp.float32), dt_ref[ci][:, None], lc[:, None],
                      lc[None, :], l_last, b_ref[ci], c_ref[ci], s)
    y_ref[ci] = y.astype(y_ref.dtype)
    return s

  s_out_ref[...] = jax.lax.fori_loop(0, num_chunks, body, s0_ref[...])


def ssd_gpu(x, dt, lcum, b_mat, c_mat, s0, *, interpret, block_p=32):
  """Inputs as ``kernel.prepare`` returns them; returns (y [b,h,nc,C,p], S_final)."""
  b, h, nc, c, p = x.shape
  g, n = b_mat.shape[1], b_mat.shape[-1]
  rep = h // g
  require(c >= 16 and c & (c - 1) == 0,
          f"GPU ssd needs a power-of-two chunk_size >= 16, got {c}")
  pp, npad = _pow2(p), _pow2(n)
  bp = min(block_p, pp)
  x = pad_axis(x, 4, pp)
  b_mat, c_mat = (pad_axis(z, 4, npad) for z in (b_mat, c_mat))
  s0 = pad_axis(pad_axis(s0, 2, pp), 3, npad)

  x_spec = pc.BlockSpec((None, None, nc, c, bp), lambda bi, hi, pi: (bi, hi, 0, 0, pi))
  seq_spec = pc.BlockSpec((None, None, nc, c), lambda bi, hi, pi: (bi, hi, 0, 0))
  grp_spec = pc.BlockSpec((None, None, nc, c, npad), lambda bi, hi, pi: (bi, hi // rep, 0, 0, 0))
  state_spec = pc.BlockSpec((None, None, bp, npad), lambda bi, hi, pi: (bi, hi, pi, 0))
  y, s = pc.gpu_call(
      functools.partial(_gpu_kernel, num_chunks=nc, chunk=c),
      out_shape=(jax.ShapeDtypeStruct((b, h, nc, c, pp), x.dtype),
                 jax.ShapeDtypeStruct((b, h, pp, npad), jnp.float32)),
      grid=(b, h, pp // bp),
      in_specs=[x_spec, seq_spec, seq_spec, grp_spec, grp_spec, state_spec],
      out_specs=(x_spec, state_spec),
      num_warps=4,
      num_stages=2,
      interpret=interpret,
      name="ssd_gpu",
  )(x, dt, lcum, b_mat, c_mat, s0)
  return y[..., :p], s[:, :, :p, :n]
