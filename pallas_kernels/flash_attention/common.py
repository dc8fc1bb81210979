"""Flash-attention pieces shared by the TPU (``kernel``) and GPU (``kernel_gpu``)
kernels and by ``paged_attention``: tile bounds and visibility, the per-element
mask and the online-softmax update. Both kernel files import from here, so they
never import each other.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _compat as pc

_BIG = 1 << 30  # sentinel position: larger than any real one, safe to subtract


def block_bounds(q_positions, kv_positions, bq, bk):
  """Per-tile position bounds used to skip tiles.

  Args:
    q_positions: [batch, t_pad] (padded queries carry -1).
    kv_positions: [batch, s_pad] (negative = no key).

  Returns:
    (q_min, q_max) [batch * nq] and (kv_min, kv_max) [batch * nk] int32 over
    the valid keys of each tile; a tile without keys gets min = _BIG so no
    query ever visits it.
  """
  b = q_positions.shape[0]
  qb = q_positions.reshape(b, -1, bq)
  kb = kv_positions.reshape(b, -1, bk)
  valid = kb >= 0
  kv_min = jnp.min(jnp.where(valid, kb, _BIG), axis=-1)
  kv_max = jnp.max(jnp.where(valid, kb, -_BIG), axis=-1)
  return (jnp.min(qb, -1).reshape(-1), jnp.max(qb, -1).reshape(-1),
          kv_min.reshape(-1), kv_max.reshape(-1))


def tile_visible(q_min, q_max, kv_min, kv_max, window):
  """Whether some query of the tile may see some key of the tile (conservative)."""
  run = kv_min <= q_max
  if window is not None:
    run = jnp.logical_and(run, q_min - kv_max < window)
  return run


def element_mask(qp, kp, window, qs=None, ks=None):
  """[rows, cols] visibility from qp [rows, 1] and kp [1, cols] (and segments)."""
  mask = jnp.logical_and(kp >= 0, kp <= qp)
  if window is not None:
    mask = jnp.logical_and(mask, qp - kp < window)
  if qs is not None:
    mask = jnp.logical_and(mask, qs == ks)
  return mask


def online_softmax_update(s, mask, m_prev, l_prev, acc_prev, v):
  """One tile of online softmax; s [rows, cols] f32, v [cols, dv].

  m stays -inf for a row until it sees its first key, so the shift used for
  exp is 0 then and nothing ever computes inf - inf.
  """
  s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
  alpha = jnp.exp(jnp.where(m_prev == -jnp.inf, m_safe, m_prev) - m_safe)
  l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
  acc_new = alpha * acc_prev + pc.dot(p.astype(v.dtype), v)
  return m_new, l_new, acc_new


def finalize(acc, l):
  return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
