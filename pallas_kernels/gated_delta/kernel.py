"""Gated delta rule: Pallas kernel for the chunk-to-chunk recurrence (TPU form).

The chunk form splits into a state-independent half (the decayed Gram
matrices, the UT transform T = (I + A)^{-1} and the WY factors; parallel over
all chunks, done by ``reference.chunk_prepare`` in XLA) and a sequential half
that threads the dk x dv state through the chunks:

    U   = W_v - W_k S
    O   = Q_dec S + P U
    S  <- diag(decay) S + K_end^T U

The kernel fuses the sequential half so the state never leaves VMEM: grid
(batch, head, dv_block, chunk) with the chunk axis "arbitrary" and S in a
scratch buffer; columns of S (value channels) are independent, so dv blocks
run in parallel. The XLA path would instead round-trip S through HBM every
chunk (a scan), which is what dominates for long prompts.

The per-channel (KDA) pairwise decays stay in the prepare step, where the
recursive halving in ``reference.decayed_gram`` keeps every exponent <= 0
without a [C, C, dk] tensor of pairwise exponents.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc
from pallas_kernels import _dispatch
from pallas_kernels._common import require
from pallas_kernels.gated_delta import kernel_gpu
from pallas_kernels.gated_delta.reference import (check_chunk_inputs, chunk_prepare, unchunk)


def _tpu_kernel(w_v_ref, w_k_ref, q_dec_ref, p_ref, k_end_ref, decay_ref, s0_ref,
                o_ref, s_out_ref, s_sc, *, num_chunks):
  ci = pc.program_id(3)

  @pc.when(ci == 0)
  def _init():
    s_sc[...] = s0_ref[...]

  s = s_sc[...]                                                   # [dk, bv]
  u = w_v_ref[...] - pc.dot(w_k_ref[...], s)                      # [C, bv]
  o_ref[...] = pc.dot(q_dec_ref[...], s) + pc.dot(p_ref[...], u)
  s = decay_ref[...] * s + pc.dot_tn(k_end_ref[...], u)           # decay [dk|1, 1]
  s_sc[...] = s

  @pc.when(ci == num_chunks - 1)
  def _final():
    s_out_ref[...] = s


def _recurrence_tpu(prep, s0, *, interpret):
  b, h, n, c, dv = prep["w_v"].shape
  dk = prep["w_k"].shape[-1]
  if not interpret:
    require(c % 8 == 0, f"TPU gated delta needs chunk_size % 8 == 0, got {c}")
  # Value-channel blocks: lane-aligned when dv allows, else one block.
  bv = 128 if dv % 128 == 0 else dv
  nv = dv // bv
  decay = prep["decay"][..., None]                                # [b, h, n, dk|1, 1]
  dd = decay.shape[-2]

  def chunk_spec(last, v_blocked=False):
    if v_blocked:
      return pc.BlockSpec((None, None, None, c, bv), lambda bi, hi, vi, ci: (bi, hi, ci, 0, vi))
    return pc.BlockSpec((None, None, None, c, last), lambda bi, hi, vi, ci: (bi, hi, ci, 0, 0))

  state_spec = pc.BlockSpec((None, None, dk, bv), lambda bi, hi, vi, ci: (bi, hi, 0, vi))
  in_specs = [chunk_spec(bv, True), chunk_spec(dk), chunk_spec(dk), chunk_spec(c), chunk_spec(dk),
              pc.BlockSpec((None, None, None, dd, 1), lambda bi, hi, vi, ci: (bi, hi, ci, 0, 0)),
              state_spec]
  flops = 2 * b * h * n * (c * dk * dv * 3 + c * c * dv)
  nbytes = 4 * (sum(prep[k].size for k in ("w_k", "q_dec", "p", "k_end")) * nv
                + prep["w_v"].size * 2 + 2 * s0.size)
  return pc.tpu_call(
      functools.partial(_tpu_kernel, num_chunks=n),
      out_shape=(jax.ShapeDtypeStruct((b, h, n, c, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32)),
      grid=(b, h, nv, n),
      in_specs=in_specs,
      out_specs=(chunk_spec(bv, True), state_spec),
      scratch_shapes=[pc.vmem((dk, bv), jnp.float32)],
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      name="gated_delta_recurrence_tpu",
      cost_estimate=pc.cost(flops, 0, nbytes),
  )(prep["w_v"], prep["w_k"], prep["q_dec"], prep["p"], prep["k_end"], decay, s0)


def chunk_gated_delta_pallas(q, k, v, g, beta, *, initial_state=None, chunk_size=64, scale=None,
                             backend="pallas_tpu"):
  """Pallas chunked gated delta rule; arguments and results as ``ops.chunk_gated_delta``."""
  b, t, h, dk, dv, _ = check_chunk_inputs(q, k, v, g, beta, initial_state)
  require(chunk_size >= 1, f"chunk_size must be positive, got {chunk_size}")
  form, interpret = _dispatch.kernel_form(backend)
  scale = dk ** -0.5 if scale is None else scale
  prep = chunk_prepare(q, k, v, g, beta, chunk_size=chunk_size, scale=scale)
  s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  if form == pc.TPU:
    o, s = _recurrence_tpu(prep, s0, interpret=interpret)
  else:
    o, s = kernel_gpu.recurrence_gpu(prep, s0, interpret=interpret)
  return unchunk(o, t).astype(q.dtype), s
