"""Masked attention: dense reference and a blocked online-softmax XLA form.

Key j is visible to query i iff
    kv_pos[j] >= 0                     (negative marks padding / empty slots),
    kv_pos[j] <= q_pos[i]              (causal by position, not by index),
    window is None or q_pos[i] - kv_pos[j] < window,
    q_seg[i] == kv_seg[j]              (when segment ids are given).
A query with no visible key returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, cdiv, pad_axis, require, shape_str


def check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
  """Validates shapes; returns (b, t, s, hq, hkv, d, dv)."""
  require(q.ndim == 4 and k.ndim == 4 and v.ndim == 4,
          f"q, k, v must be [batch, seq, heads, head_dim], got {shape_str(q=q, k=k, v=v)}")
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  require(k.shape == (b, s, hkv, d), f"k must be {(b, s, hkv, d)}, got {k.shape}")
  require(v.shape[:3] == (b, s, hkv), f"v must be [{b}, {s}, {hkv}, dv], got {v.shape}")
  require(hkv > 0 and hq % hkv == 0, f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
  require(q_positions.shape == (b, t), f"q_positions must be {(b, t)}, got {q_positions.shape}")
  require(kv_positions.shape == (b, s), f"kv_positions must be {(b, s)}, got {kv_positions.shape}")
  require((q_segment_ids is None) == (kv_segment_ids is None),
          "q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    require(q_segment_ids.shape == (b, t), f"q_segment_ids must be {(b, t)}, got {q_segment_ids.shape}")
    require(kv_segment_ids.shape == (b, s),
            f"kv_segment_ids must be {(b, s)}, got {kv_segment_ids.shape}")
  return b, t, s, hq, hkv, d, v.shape[3]


def visibility(q_positions, kv_positions, window, q_segment_ids=None, kv_segment_ids=None):
  """Boolean [batch, t, s] mask of the rule in the module docstring."""
  qp = q_positions[:, :, None]
  kp = kv_positions[:, None, :]
  mask = (kp >= 0) & (kp <= qp)
  if window is not None:
    mask &= (qp - kp) < window
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return mask


def attention_reference(q, k, v, *, q_positions, kv_positions, window=None,
                        q_segment_ids=None, kv_segment_ids=None, sm_scale=None):
  """Dense masked softmax attention in f32.

  Args:
    q: [batch, t, hq, d].
    k: [batch, s, hkv, d].
    v: [batch, s, hkv, dv].
    q_positions: [batch, t] int32.
    kv_positions: [batch, s] int32 (negative = padding).
    window: sliding window size or None.
    q_segment_ids, kv_segment_ids: [batch, t] / [batch, s] or None.
    sm_scale: softmax scale, default d**-0.5.

  Returns:
    [batch, t, hq, dv] in q.dtype.
  """
  b, t, _, hq, hkv, d, dv = check_inputs(q, k, v, q_positions, kv_positions,
                                         q_segment_ids, kv_segment_ids)
  sm_scale = d ** -0.5 if sm_scale is None else sm_scale
  f32 = jnp.float32
  qg = q.astype(f32).reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(f32), precision=HIGHEST) * sm_scale
  mask = visibility(q_positions, kv_positions, window, q_segment_ids, kv_segment_ids)
  mask = mask[:, None, None]
  scores = jnp.where(mask, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkgts,bskv->bkgtv", p, v.astype(f32), precision=HIGHEST)
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, hq, dv).astype(q.dtype)


def attention_xla(q, k, v, *, q_positions, kv_positions, window=None, q_segment_ids=None,
                  kv_segment_ids=None, sm_scale=None, block_k=512):
  """Online-softmax attention scanning over key blocks; memory O(t * block_k).

  Same arguments and result as ``attention_reference``; ``block_k`` is the
  number of keys per scan step (the key axis is padded with kv_pos = -1).
  """
  b, t, s, hq, hkv, d, dv = check_inputs(q, k, v, q_positions, kv_positions,
                                         q_segment_ids, kv_segment_ids)
  require(block_k >= 1, f"block_k must be positive, got {block_k}")
  sm_scale = d ** -0.5 if sm_scale is None else sm_scale
  f32 = jnp.float32
  grp = hq // hkv
  bk = min(block_k, s)
  nk = cdiv(s, bk)
  k = pad_axis(k, 1, nk * bk)
  v = pad_axis(v, 1, nk * bk)
  kv_positions = pad_axis(kv_positions, 1, nk * bk, value=-1)
  has_seg = q_segment_ids is not None
  if has_seg:
    kv_segment_ids = pad_axis(kv_segment_ids, 1, nk * bk, value=-1)
  else:
    kv_segment_ids = jnp.zeros_like(kv_positions)
  qg = q.astype(f32).reshape(b, t, hkv, grp, d) * sm_scale

  def blocks(x):
    return jnp.moveaxis(x.reshape(b, nk, bk, *x.shape[2:]), 1, 0)

  def body(carry, xs):
    m, l, acc = carry
    kb, vb, kp, ks = xs
    sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb.astype(f32), precision=HIGHEST)
    mask = visibility(q_positions, kp, window,
                      q_segment_ids if has_seg else None, ks if has_seg else None)
    mask = mask[:, None, None]
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, sc, -jnp.inf), axis=-1))
    # m stays -inf until a row sees its first key; use 0 as the shift then so
    # exp never sees inf - inf.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(sc - m_safe[..., None]), 0.0)
    alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("bkgts,bskv->bkgtv", p, vb.astype(f32),
                                              precision=HIGHEST)
    return (m_new, l, acc), None

  init = (jnp.full((b, hkv, grp, t), -jnp.inf, f32), jnp.zeros((b, hkv, grp, t), f32),
          jnp.zeros((b, hkv, grp, t, dv), f32))
  (_, l, acc), _ = jax.lax.scan(
      body, init, (blocks(k), blocks(v), blocks(kv_positions), blocks(kv_segment_ids)))
  o = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, hq, dv).astype(q.dtype)
