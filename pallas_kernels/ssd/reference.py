"""Mamba2 state-space duality (SSD) scan: naive recurrence and the chunked XLA form.

Per batch and head the state is S in R^{p x n}; for each token t

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T
    y_t = S_t C_t

with B, C shared by the h // g heads of a group (head i uses group i // (h // g)).
No D skip and no output gate: the caller adds them.

Chunk form. With a_t = dt_t A and L_i the cumulative sum of a inside a chunk,

    y_i   = exp(L_i) S_0 C_i + sum_{j<=i} exp(L_i - L_j) (C_i . B_j) dt_j x_j
    S_end = exp(L_C) S_0 + sum_j exp(L_C - L_j) dt_j x_j B_j^T

The intra-chunk terms of all chunks run in parallel; only the chunk-to-chunk
state hand-off is a (short) sequential scan. Exponents of differences are
masked to j <= i before the exp, so nothing overflows when A < 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, cdiv, pad_axis, require


def check_inputs(x, dt, a, b_mat, c_mat, initial_state):
  """Validates shapes; returns (b, t, h, p, g, n)."""
  require(x.ndim == 4, f"x must be [batch, seq, heads, head_dim], got {x.shape}")
  b, t, h, p = x.shape
  require(dt.shape == (b, t, h), f"dt must be {(b, t, h)}, got {dt.shape}")
  require(a.shape == (h,), f"A must be {(h,)}, got {a.shape}")
  require(b_mat.ndim == 4 and b_mat.shape[:2] == (b, t),
          f"B must be [batch, seq, groups, state], got {b_mat.shape}")
  g, n = b_mat.shape[2:]
  require(c_mat.shape == b_mat.shape, f"C must match B {b_mat.shape}, got {c_mat.shape}")
  require(h % g == 0, f"heads ({h}) must be a multiple of groups ({g})")
  if initial_state is not None:
    require(initial_state.shape == (b, h, p, n),
            f"initial_state must be {(b, h, p, n)}, got {initial_state.shape}")
  return b, t, h, p, g, n


def check_step_inputs(x, dt, a, b_mat, c_mat, state):
  require(x.ndim == 3, f"x must be [batch, heads, head_dim], got {x.shape}")
  b, h, p = x.shape
  require(dt.shape == (b, h), f"dt must be {(b, h)}, got {dt.shape}")
  require(a.shape == (h,), f"A must be {(h,)}, got {a.shape}")
  require(b_mat.ndim == 3 and b_mat.shape[0] == b,
          f"B must be [batch, groups, state], got {b_mat.shape}")
  g, n = b_mat.shape[1:]
  require(c_mat.shape == b_mat.shape, f"C must match B {b_mat.shape}, got {c_mat.shape}")
  require(h % g == 0, f"heads ({h}) must be a multiple of groups ({g})")
  require(state.shape == (b, h, p, n), f"state must be {(b, h, p, n)}, got {state.shape}")
  return b, h, p, g, n


def ssd_step_reference(x, dt, a, b_mat, c_mat, state):
  """One decode token.

  Args:
    x: [batch, heads, head_dim].
    dt: [batch, heads] (already softplus-ed / clamped by the caller).
    a: [heads] (negative for a decaying state).
    b_mat, c_mat: [batch, groups, state_dim].
    state: [batch, heads, head_dim, state_dim].

  Returns:
    (y [batch, heads, head_dim] in x.dtype, new_state [batch, heads, head_dim, state_dim] f32).
  """
  _, h, _, g, _ = check_step_inputs(x, dt, a, b_mat, c_mat, state)
  out_dtype = x.dtype
  f32 = jnp.float32
  x, dt, a, b_mat, c_mat, s = (z.astype(f32) for z in (x, dt, a, b_mat, c_mat, state))
  b_h = jnp.repeat(b_mat, h // g, axis=1)
  c_h = jnp.repeat(c_mat, h // g, axis=1)
  decay = jnp.exp(dt * a[None, :])
  s = decay[..., None, None] * s + (dt[..., None] * x)[..., :, None] * b_h[..., None, :]
  y = jnp.einsum("bhpn,bhn->bhp", s, c_h, precision=HIGHEST)
  return y.astype(out_dtype), s


def ssd_naive(x, dt, a, b_mat, c_mat, *, initial_state=None):
  """Token-by-token recurrence; the obviously-right baseline.

  Args:
    x: [batch, seq, heads, head_dim].
    dt: [batch, seq, heads].
    a: [heads].
    b_mat, c_mat: [batch, seq, groups, state_dim].
    initial_state: [batch, heads, head_dim, state_dim] or None (zeros).

  Returns:
    (y [batch, seq, heads, head_dim] in x.dtype, final_state f32).
  """
  b, _, h, p, _, n = check_inputs(x, dt, a, b_mat, c_mat, initial_state)
  s0 = (jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(s, xs):
    xt, dtt, bt, ct = xs
    y, s = ssd_step_reference(xt, dtt, a, bt, ct, s)
    return s, y.astype(jnp.float32)

  xs = tuple(jnp.moveaxis(z, 1, 0) for z in (x, dt, b_mat, c_mat))
  s, y = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(y, 0, 1).astype(x.dtype), s


def ssd_xla(x, dt, a, b_mat, c_mat, *, initial_state=None, chunk_size=64):
  """Chunked SSD (see module docstring); the CPU fast path.

  Args:
    x: [batch, seq, heads, head_dim].
    dt: [batch, seq, heads].
    a: [heads].
    b_mat, c_mat: [batch, seq, groups, state_dim].
    initial_state: [batch, heads, head_dim, state_dim] or None (zeros).
    chunk_size: tokens per chunk; seq needs not be a multiple (padded inside
      with dt = 0, which leaves the state unchanged).

  Returns:
    (y [batch, seq, heads, head_dim] in x.dtype, final_state f32).
  """
  b, t, h, p, g, n = check_inputs(x, dt, a, b_mat, c_mat, initial_state)
  require(chunk_size >= 1, f"chunk_size must be positive, got {chunk_size}")
  out_dtype = x.dtype
  f32 = jnp.float32
  c = chunk_size
  nc = cdiv(t, c)
  r = h // g
  x, dt, b_mat, c_mat = (pad_axis(z.astype(f32), 1, nc * c) for z in (x, dt, b_mat, c_mat))
  a = a.astype(f32)

  # Heads split as [groups, heads_per_group] so B/C are never repeated.
  x = jnp.transpose(x.reshape(b, nc, c, g, r, p), (0, 3, 4, 1, 2, 5))     # [b,g,r,nc,c,p]
  dt = jnp.transpose(dt.reshape(b, nc, c, g, r), (0, 3, 4, 1, 2))        # [b,g,r,nc,c]
  b_mat = jnp.transpose(b_mat.reshape(b, nc, c, g, n), (0, 3, 1, 2, 4))  # [b,g,nc,c,n]
  c_mat = jnp.transpose(c_mat.reshape(b, nc, c, g, n), (0, 3, 1, 2, 4))
  lcum = jnp.cumsum(dt * a.reshape(g, r)[None, :, :, None, None], axis=-1)  # [b,g,r,nc,c]

  idx = jnp.arange(c)
  causal = idx[None, :] <= idx[:, None]
  seg = jnp.exp(jnp.where(causal, lcum[..., :, None] - lcum[..., None, :], -jnp.inf))
  cb = jnp.einsum("bgcin,bgcjn->bgcij", c_mat, b_mat, precision=HIGHEST)  # [b,g,nc,c,c]
  xdt = x * dt[..., None]
  y_intra = jnp.einsum("bgrcij,bgrcjp->bgrcip", cb[:, :, None] * seg, xdt, precision=HIGHEST)

  l_last = lcum[..., -1:]                                                 # [b,g,r,nc,1]
  local_state = jnp.einsum("bgrcjp,bgcjn->bgrcpn", xdt * jnp.exp(l_last - lcum)[..., None],
                           b_mat, precision=HIGHEST)                      # [b,g,r,nc,p,n]
  chunk_decay = jnp.exp(l_last[..., 0])                                   # [b,g,r,nc]

  def hand_off(s, xs):
    dec, loc = xs
    return dec[..., None, None] * s + loc, s  # emit the state entering this chunk

  s0 = (jnp.zeros((b, h, p, n), f32) if initial_state is None
        else initial_state.astype(f32)).reshape(b, g, r, p, n)
  s_final, s_in = jax.lax.scan(
      hand_off, s0, (jnp.moveaxis(chunk_decay, 3, 0), jnp.moveaxis(local_state, 3, 0)))
  s_in = jnp.moveaxis(s_in, 0, 3)                                         # [b,g,r,nc,p,n]
  y_state = jnp.einsum("bgrcpn,bgcin->bgrcip", s_in, c_mat,
                       precision=HIGHEST) * jnp.exp(lcum)[..., None]
  y = y_intra + y_state                                                   # [b,g,r,nc,c,p]
  y = jnp.transpose(y, (0, 3, 4, 1, 2, 5)).reshape(b, nc * c, h, p)[:, :t]
  return y.astype(out_dtype), s_final.reshape(b, h, p, n)
