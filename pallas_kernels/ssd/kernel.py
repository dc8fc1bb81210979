"""Mamba2 SSD as one fused Pallas kernel (TPU form).

Grid (batch, head, head_dim block, chunk), the chunk axis "arbitrary"; the
[bp, n] state slice lives in VMEM scratch. Each step reads the chunk's x, dt
and the group's B, C once and does everything of the chunk form (see
``reference.py``): the causal decayed C.B^T product, the intra-chunk output,
the contribution of the incoming state, and the state update. Nothing
intermediate (per-chunk states, the [C, C] matrices) touches HBM.

The in-chunk cumulative log decay L is a cheap cumsum done in XLA and passed
both as a column [C, 1] and a row [1, C], so the kernel forms the pairwise
differences L_i - L_j by broadcasting (masked to j <= i before the exp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels import _dispatch
from pallas_kernels._common import cdiv, pad_axis, require
from pallas_kernels.ssd import kernel_gpu
from pallas_kernels.ssd.common import chunk_step
from pallas_kernels.ssd.reference import check_inputs


def _tpu_kernel(x_ref, dt_ref, lc_ref, lr_ref, b_ref, c_ref, s0_ref, y_ref, s_out_ref, s_sc, *,
                num_chunks):
  ci = pc.program_id(3)

  @pc.when(ci == 0)
  def _init():
    s_sc[...] = s0_ref[...]

  lr = lr_ref[...]
  c = lr.shape[1]
  y, s = chunk_step(x_ref[...].astype(jnp.float32), dt_ref[...], lc_ref[...], lr,
                    lr[:, c - 1:c], b_ref[...], c_ref[...], s_sc[...])
  y_ref[...] = y.astype(y_ref.dtype)
  s_sc[...] = s

  @pc.when(ci == num_chunks - 1)
  def _final():
    s_out_ref[...] = s


def prepare(x, dt, a, b_mat, c_mat, chunk_size):
  """Chunk-major layouts shared by both kernel forms.

  Returns x [b,h,nc,C,p], dt and L [b,h,nc,C] (f32), B and C [b,g,nc,C,n],
  padded to whole chunks with dt = 0 (which leaves the state unchanged).
  """
  b, t, h, p = x.shape
  g, n = b_mat.shape[2:]
  c = chunk_size
  nc = cdiv(t, c)
  x, b_mat, c_mat = (pad_axis(z, 1, nc * c) for z in (x, b_mat, c_mat))
  dt = pad_axis(dt.astype(jnp.float32), 1, nc * c)
  dt = jnp.transpose(dt.reshape(b, nc, c, h), (0, 3, 1, 2))                   # [b,h,nc,C]
  lcum = jnp.cumsum(dt * a.astype(jnp.float32)[None, :, None, None], axis=-1)
  x = jnp.transpose(x.reshape(b, nc, c, h, p), (0, 3, 1, 2, 4))               # [b,h,nc,C,p]
  b_mat, c_mat = (jnp.transpose(z.reshape(b, nc, c, g, n), (0, 3, 1, 2, 4))
                  for z in (b_mat, c_mat))                                    # [b,g,nc,C,n]
  return x, dt, lcum, b_mat, c_mat


def _ssd_tpu(x, dt, lcum, b_mat, c_mat, s0, *, interpret):
  b, h, nc, c, p = x.shape
  g, n = b_mat.shape[1], b_mat.shape[-1]
  rep = h // g
  if not interpret:
    require(c % 8 == 0, f"TPU ssd needs chunk_size % 8 == 0, got {c}")
  bp = 128 if p % 128 == 0 else p
  npb = p // bp

  x_spec = pc.BlockSpec((None, None, None, c, bp), lambda bi, hi, pi, ci: (bi, hi, ci, 0, pi))
  col_spec = pc.BlockSpec((None, None, None, c, 1), lambda bi, hi, pi, ci: (bi, hi, ci, 0, 0))
  row_spec = pc.BlockSpec((None, None, None, 1, c), lambda bi, hi, pi, ci: (bi, hi, ci, 0, 0))
  # Non-negative operands: truncating lax.div is floor division without the
  # sign fix-up that `//` lowers to.
  grp_spec = pc.BlockSpec((None, None, None, c, n),
                          lambda bi, hi, pi, ci: (bi, jax.lax.div(hi, rep), ci, 0, 0))
  state_spec = pc.BlockSpec((None, None, bp, n), lambda bi, hi, pi, ci: (bi, hi, pi, 0))
  flops = 2 * b * h * nc * (c * c * n + c * c * p + 2 * c * p * n)
  nbytes = (x.size * x.dtype.itemsize * 2 + (b_mat.size + c_mat.size) * b_mat.dtype.itemsize * rep
            * npb + 8 * s0.size)
  return pc.tpu_call(
      functools.partial(_tpu_kernel, num_chunks=nc),
      out_shape=(jax.ShapeDtypeStruct((b, h, nc, c, p), x.dtype),
                 jax.ShapeDtypeStruct((b, h, p, n), jnp.float32)),
      grid=(b, h, npb, nc),
      in_specs=[x_spec, col_spec, col_spec, row_spec, grp_spec, grp_spec, state_spec],
      out_specs=(x_spec, state_spec),
      scratch_shapes=[pc.vmem((bp, n), jnp.float32)],
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      name="ssd_tpu",
      cost_estimate=pc.cost(flops, b * h * nc * c * (c + 2), nbytes),
  )(x, dt[..., None], lcum[..., None], lcum[..., None, :], b_mat, c_mat, s0)


def ssd_pallas(x, dt, a, b_mat, c_mat, *, initial_state=None, chunk_size=64, backend="pallas_tpu"):
  """Pallas SSD; arguments and results as ``ops.ssd``."""
  b, t, h, p, _, n = check_inputs(x, dt, a, b_mat, c_mat, initial_state)
  require(chunk_size >= 1, f"chunk_size must be positive, got {chunk_size}")
  form, interpret = _dispatch.kernel_form(backend)
  s0 = (jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  xc, dtc, lcum, bc, cc = prepare(x, dt, a, b_mat, c_mat, chunk_size)
  if form == pc.TPU:
    y, s = _ssd_tpu(xc, dtc, lcum, bc, cc, s0, interpret=interpret)
  else:
    y, s = kernel_gpu.ssd_gpu(xc, dtc, lcum, bc, cc, s0, interpret=interpret)
  nc, c = y.shape[2], y.shape[3]
  y = jnp.transpose(y, (0, 2, 3, 1, 4)).reshape(b, nc * c, h, p)[:, :t]
  return y.astype(x.dtype), s
