"""The SSD chunk step shared by the TPU (``kernel``) and GPU (``kernel_gpu``) kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as pc

def chunk_step(x, dt, lc, lr, l_last, bm, cm, s):
  """One chunk of SSD for one head (and head-dim slice).

  Args:
    x: [C, bp] f32;  dt, lc: [C, 1] f32 (lc = cumulative log decay);
    lr: [1, C] (lc as a row);  l_last: [1, 1] (lc of the chunk's last token);
    bm, cm: [C, n] (input dtype);  s: [bp, n] f32 incoming state.

  Returns:
    (y [C, bp] f32, new state [bp, n] f32).
  """
  c = x.shape[0]
  rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  seg = jnp.exp(jnp.where(cols <= rows, lc - lr, -jnp.inf))
  xdt = x * dt
  y = pc.dot(pc.dot(cm, bm, trans_b=True) * seg, xdt)
  y = y + jnp.exp(lc) * pc.dot(cm.astype(jnp.float32), s, trans_b=True)
  s = jnp.exp(l_last) * s + pc.dot_tn(xdt * jnp.exp(l_last - lc), bm.astype(jnp.float32))
  return y, s
