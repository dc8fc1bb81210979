"""Gated delta rule: naive recurrence and the chunked (WY / UT-transform) XLA form.

Per batch and head the state is S in R^{dk x dv}; for each token t

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale q_t)

with g the log decay, either one scalar per head (Gated DeltaNet, ``g[b,t,h]``) or
one value per key channel (KDA, ``g[b,t,h,dk]``).

Chunk form. Inside a chunk of C tokens let G_i be the cumulative log decay from
the chunk start up to and including token i (a vector over key channels; a
scalar broadcast for GDN), and S_0 the state entering the chunk. Writing
S_i = diag(exp G_i) (S_0 + sum_{j<=i} (exp(-G_j) k_j) u_j^T), the update
becomes a unit-lower-triangular system for the "pseudo values" u:

    u_i + sum_{j<i} A_ij u_j = beta_i (v_i - (exp(G_i) k_i)^T S_0)
    A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)                  (j < i)

so U = T diag(beta) V - T diag(beta) K_dec S_0 with T = (I + A)^{-1} (the
UT transform; W = T diag(beta) K_dec is the WY representation). Then

    o_i   = (exp(G_i) q_i)^T S_0 + sum_{j<=i} P_ij u_j,
    P_ij  = sum_c q_ic k_jc exp(G_ic - G_jc)                         (j <= i)
    S_C   = diag(exp G_C) S_0 + sum_j (exp(G_C - G_j) k_j) u_j^T.

Every exponent above is a difference G_i - G_j with j <= i, which is <= 0
because g <= 0; no factor ever overflows. The per-channel pairwise sums are
computed without materialising exp(+G) anywhere (see ``decayed_gram``), and
T comes from a blocked forward substitution (``unit_lower_inverse``).
All math is f32; outputs come back in the input dtype, states in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, cdiv, pad_axis, require, shape_str

def check_chunk_inputs(q, k, v, g, beta, initial_state):
  """Validates shapes; returns (b, t, h, dk, dv, per_channel)."""
  require(q.ndim == 4, f"q must be [batch, seq, heads, dk], got {q.shape}")
  b, t, h, dk = q.shape
  require(k.shape == q.shape, f"k must match q {q.shape}, got {k.shape}")
  require(v.ndim == 4 and v.shape[:3] == (b, t, h),
          f"v must be [batch, seq, heads, dv] matching q, got {shape_str(q=q, v=v)}")
  dv = v.shape[-1]
  require(beta.shape == (b, t, h), f"beta must be {(b, t, h)}, got {beta.shape}")
  if g.shape == (b, t, h):
    per_channel = False
  elif g.shape == (b, t, h, dk):
    per_channel = True
  else:
    raise ValueError(
        f"g must be [batch, seq, heads] (GDN) or [batch, seq, heads, dk] (KDA) = "
        f"{(b, t, h)} or {(b, t, h, dk)}, got {g.shape}")
  if initial_state is not None:
    require(initial_state.shape == (b, h, dk, dv),
            f"initial_state must be {(b, h, dk, dv)}, got {initial_state.shape}")
  return b, t, h, dk, dv, per_channel


def check_step_inputs(q, k, v, g, beta, state):
  require(q.ndim == 3, f"q must be [batch, heads, dk], got {q.shape}")
  b, h, dk = q.shape
  require(k.shape == q.shape, f"k must match q {q.shape}, got {k.shape}")
  require(v.ndim == 3 and v.shape[:2] == (b, h), f"v must be [batch, heads, dv], got {v.shape}")
  dv = v.shape[-1]
  require(g.shape in ((b, h), (b, h, dk)),
          f"g must be {(b, h)} (GDN) or {(b, h, dk)} (KDA), got {g.shape}")
  require(beta.shape == (b, h), f"beta must be {(b, h)}, got {beta.shape}")
  require(state.shape == (b, h, dk, dv), f"state must be {(b, h, dk, dv)}, got {state.shape}")
  return b, h, dk, dv


def gated_delta_step_reference(q, k, v, g, beta, state, *, scale=None):
  """One decode token.

  Args:
    q, k: [batch, heads, dk].
    v: [batch, heads, dv].
    g: [batch, heads] or [batch, heads, dk] log decay (<= 0).
    beta: [batch, heads].
    state: [batch, heads, dk, dv].
    scale: query scale, default dk**-0.5.

  Returns:
    (o [batch, heads, dv] in q.dtype, new_state [batch, heads, dk, dv] f32).
  """
  _, _, dk, _ = check_step_inputs(q, k, v, g, beta, state)
  scale = dk ** -0.5 if scale is None else scale
  out_dtype = q.dtype
  f32 = jnp.float32
  q, k, v, g, beta, s = (x.astype(f32) for x in (q, k, v, g, beta, state))
  decay = jnp.exp(g)
  decay = decay[..., None, None] if decay.ndim == 2 else decay[..., None]
  s = s * decay
  pred = jnp.einsum("bhk,bhkv->bhv", k, s, precision=HIGHEST)
  u = beta[..., None] * (v - pred)
  s = s + k[..., :, None] * u[..., None, :]
  o = jnp.einsum("bhk,bhkv->bhv", q * scale, s, precision=HIGHEST)
  return o.astype(out_dtype), s


def gated_delta_naive(q, k, v, g, beta, *, initial_state=None, scale=None):
  """Token-by-token recurrence; the obviously-right baseline.

  Args:
    q, k: [batch, seq, heads, dk].
    v: [batch, seq, heads, dv].
    g: [batch, seq, heads] or [batch, seq, heads, dk].
    beta: [batch, seq, heads].
    initial_state: [batch, heads, dk, dv] or None (zeros).

  Returns:
    (o [batch, seq, heads, dv] in q.dtype, final_state [batch, heads, dk, dv] f32).
  """
  b, _, h, dk, dv, _ = check_chunk_inputs(q, k, v, g, beta, initial_state)
  s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(s, xs):
    qt, kt, vt, gt, bt = xs
    o, s = gated_delta_step_reference(qt, kt, vt, gt, bt, s, scale=scale)
    return s, o.astype(jnp.float32)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
  s, o = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(o, 0, 1).astype(q.dtype), s


def _masked_exp_diff(gi, gj, inclusive):
  """exp(gi - gj) where j <= i (or j < i), else 0; gi [..., C, 1], gj [..., 1, C]."""
  c = gi.shape[-2]
  idx = jnp.arange(c)
  mask = (idx[None, :] <= idx[:, None]) if inclusive else (idx[None, :] < idx[:, None])
  diff = gi - gj
  return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def decayed_gram(a, b, gcum, *, inclusive):
  """M_ij = sum_c a_ic b_jc exp(G_ic - G_jc) for j <= i (or j < i), else 0.

  Args:
    a, b: [..., C, dk] f32.
    gcum: [..., C] (scalar decay) or [..., C, dk] (per-channel), cumulative
      log decay within the chunk, non-increasing along C (g <= 0).
    inclusive: include the diagonal j == i.

  Returns:
    [..., C, C] f32.
  """
  c = a.shape[-2]
  if gcum.ndim == a.ndim - 1:
    e = _masked_exp_diff(gcum[..., :, None], gcum[..., None, :], inclusive)
    return jnp.einsum("...id,...jd->...ij", a, b, precision=HIGHEST) * e

  # Per-channel decay: a [C, C, dk] tensor of pairwise exponents would cost
  # C*C*dk exps per chunk. Instead split the chunk in halves, recursively: a
  # pair (i in the right half, j in the left half) factors through r, the
  # last token of the left half,
  #   exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j),   j <= r < i,
  # and both factors are <= 1, so nothing overflows (an underflow only
  # happens where the true product is smaller still). Each level is one
  # batched matmul of rescaled halves; pairs inside a half go to the next
  # level, down to single tokens, whose diagonal term has exp(0) = 1.
  cp = 1 << (c - 1).bit_length()
  if cp != c:  # zero rows/cols add nothing; a flat G keeps the order valid
    a, b = pad_axis(a, a.ndim - 2, cp), pad_axis(b, b.ndim - 2, cp)
    gcum = jnp.concatenate(
        [gcum, jnp.broadcast_to(gcum[..., -1:, :], gcum.shape[:-2] + (cp - c, gcum.shape[-1]))],
        axis=-2)
  lead, dk = a.shape[:-2], a.shape[-1]
  m = jnp.zeros(lead + (cp, cp), jnp.float32)
  size = cp
  while size >= 2:
    nb, h = cp // size, size // 2
    ab, bb, gb = (x.reshape(lead + (nb, size, dk)) for x in (a, b, gcum))
    g_ref = gb[..., h - 1:h, :]                                        # [..., nb, 1, dk]
    a_t = ab[..., h:, :] * jnp.exp(gb[..., h:, :] - g_ref)
    b_t = bb[..., :h, :] * jnp.exp(g_ref - gb[..., :h, :])
    cross = jnp.einsum("...nid,...njd->...nij", a_t, b_t, precision=HIGHEST)  # [..., nb, h, h]
    cross = jnp.pad(cross, [(0, 0)] * (cross.ndim - 2) + [(h, 0), (0, h)])  # bottom-left block
    m = m + jnp.einsum("...nij,nk->...nikj", cross, jnp.eye(nb, dtype=cross.dtype)
                       ).reshape(lead + (cp, cp))
    size //= 2
  if inclusive:
    m = m + jnp.sum(a * b, axis=-1)[..., None] * jnp.eye(cp, dtype=m.dtype)
  return m[..., :c, :c]


def _forward_substitution(a):
  """(I + a)^{-1} for strictly lower-triangular a [..., n, n], one row per
  iteration of a rolled loop: row i = e_i - a[i, :] @ T, where the rows of T
  from i on still hold the identity and a[i, j >= i] is masked to zero."""
  n = a.shape[-1]
  eye = jnp.eye(n, dtype=a.dtype)
  cols = jnp.arange(n)

  def row(i, t):
    a_i = jnp.where(cols < i, jax.lax.dynamic_slice_in_dim(a, i, 1, axis=-2), 0.0)
    t_i = (jax.lax.dynamic_slice_in_dim(eye, i, 1, axis=0)
           - jnp.einsum("...ij,...jn->...in", a_i, t, precision=HIGHEST))
    return jax.lax.dynamic_update_slice_in_dim(t, t_i, i, axis=-2)

  return jax.lax.fori_loop(1, n, row, jnp.broadcast_to(eye, a.shape))


def unit_lower_inverse(a):
  """(I + a)^{-1} for strictly lower-triangular a [..., n, n] (the UT transform).

  Block recursion: inv([[A, 0], [B, D]]) = [[A', 0], [-D' B A', D']], the two
  diagonal blocks inverted together (stacked on a new leading axis), down to
  blocks of <= 16 rows solved by forward substitution in a rolled loop. The
  traced program is O(log n) matmuls and one small loop, so it compiles in a
  fraction of the unrolled form's time (``unit_lower_inverse_unrolled``, kept
  as the exactness baseline), which traced one einsum per row and per leaf.
  Built from batched matmuls: XLA:CPU's batched ``triangular_solve`` made the
  whole prepare step ~100x slower on 64 x 64 chunks (650 ms vs 7 ms for 512
  tokens x 4 heads), and the nilpotent power series (I - a)(I + a^2)... would
  form a^(2^k), whose entries grow combinatorially when keys are correlated.
  """
  n = a.shape[-1]
  if n <= 16:
    return _forward_substitution(a)
  h = n // 2
  if n % 2:
    t11 = unit_lower_inverse(a[..., :h, :h])
    t22 = unit_lower_inverse(a[..., h:, h:])
  else:
    both = unit_lower_inverse(jnp.stack([a[..., :h, :h], a[..., h:, h:]]))
    t11, t22 = both[0], both[1]
  t21 = -jnp.einsum("...ij,...jk,...kl->...il", t22, a[..., h:, :h], t11, precision=HIGHEST)
  top = jnp.concatenate([t11, jnp.zeros(t11.shape[:-1] + (n - h,), a.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


def unit_lower_inverse_unrolled(a):
  """The pre-#17 form of ``unit_lower_inverse``: the same block recursion with
  each half traced separately and the <= 16-row leaves unrolled row by row.
  Kept as the exactness and compile-time baseline."""
  n = a.shape[-1]
  if n <= 16:
    eye = jnp.eye(n, dtype=a.dtype)
    rows = [jnp.broadcast_to(eye[0], a.shape[:-2] + (n,))]
    for i in range(1, n):
      prev = jnp.stack(rows, axis=-2)                                  # [..., i, n]
      rows.append(eye[i] - jnp.einsum("...j,...jn->...n", a[..., i, :i], prev, precision=HIGHEST))
    return jnp.stack(rows, axis=-2)
  h = n // 2
  t11 = unit_lower_inverse_unrolled(a[..., :h, :h])
  t22 = unit_lower_inverse_unrolled(a[..., h:, h:])
  t21 = -jnp.einsum("...ij,...jk,...kl->...il", t22, a[..., h:, :h], t11, precision=HIGHEST)
  top = jnp.concatenate([t11, jnp.zeros(t11.shape[:-1] + (n - h,), a.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)


# Which inverse ``chunk_prepare`` traces: benchmarks set "unrolled" to measure
# the old form's compile time (read at trace time; clear jit caches after a change).
INVERSES = {"blocked": unit_lower_inverse, "unrolled": unit_lower_inverse_unrolled}
_inverse = {"name": "blocked"}


def set_chunk_inverse(name: str) -> None:
  """Selects the UT-transform inverse for later traces (``INVERSES`` keys)."""
  if name not in INVERSES:
    raise ValueError(f"chunk inverse must be one of {sorted(INVERSES)}, got {name!r}")
  _inverse["name"] = name


def chunk_prepare(q, k, v, g, beta, *, chunk_size, scale):
  """The parallel, state-independent half of the chunk form (all chunks at once).

  Args: as ``chunk_gated_delta_xla`` (shapes already validated).

  Returns:
    Dict of f32 arrays, chunk-major per head ([b, h, n, C, ...]):
      w_v  [.., C, dv]: T diag(beta) V            (U = w_v - w_k S_0)
      w_k  [.., C, dk]: T diag(beta) K_dec
      q_dec [.., C, dk]: exp(G_i) scale q_i       (o = q_dec S_0 + P U)
      p    [.., C, C]:  decayed causal scale q.k
      k_end [.., C, dk]: exp(G_C - G_j) k_j       (S_C = decay S_0 + k_end^T U)
      decay [b, h, n, dk or 1]: exp(G_C)
  """
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  per_channel = g.ndim == 4
  f32 = jnp.float32
  c = chunk_size
  n = cdiv(t, c)
  # Right padding with g = 0 and beta = 0 leaves the state untouched; padded
  # outputs are sliced away.
  q, k, v, g, beta = (pad_axis(x.astype(f32), 1, n * c) for x in (q, k, v, g, beta))

  def to_chunks(x):  # [b, n*c, h, ...] -> [b, h, n, c, ...]
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)

  q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
  q = q * scale
  gcum = jnp.cumsum(g, axis=3)                             # [b,h,n,c] or [b,h,n,c,dk]
  gc = gcum if per_channel else gcum[..., None]            # broadcastable over dk
  g_last = gc[..., -1:, :]                                 # [b,h,n,1,dk|1]

  a_mat = beta[..., None] * decayed_gram(k, k, gcum, inclusive=False)
  # T diag(beta) [V, K_dec], T = (I + A)^{-1}.
  rhs = beta[..., None] * jnp.concatenate([v, k * jnp.exp(gc)], axis=-1)
  inverse = INVERSES[_inverse["name"]]
  sol = jnp.einsum("...ij,...jd->...id", inverse(a_mat), rhs, precision=HIGHEST)
  return dict(
      w_v=sol[..., :dv], w_k=sol[..., dv:], q_dec=q * jnp.exp(gc),
      p=decayed_gram(q, k, gcum, inclusive=True),
      k_end=k * jnp.exp(g_last - gc),                      # exponent <= 0
      decay=jnp.exp(g_last[..., 0, :]))


def chunk_recurrence_xla(prep, initial_state):
  """The sequential half: carries S across chunks. Returns (o [b,h,n,C,dv], S_final)."""

  def chunk_step(s, xs):
    w_v_c, w_k_c, q_dec_c, p_c, k_end_c, dec_c = xs
    u = w_v_c - jnp.einsum("bhck,bhkv->bhcv", w_k_c, s, precision=HIGHEST)
    o = (jnp.einsum("bhck,bhkv->bhcv", q_dec_c, s, precision=HIGHEST)
         + jnp.einsum("bhij,bhjv->bhiv", p_c, u, precision=HIGHEST))
    s = dec_c[..., :, None] * s + jnp.einsum("bhck,bhcv->bhkv", k_end_c, u, precision=HIGHEST)
    return s, o

  names = ("w_v", "w_k", "q_dec", "p", "k_end", "decay")
  xs = tuple(jnp.moveaxis(prep[name], 2, 0) for name in names)
  s, o = jax.lax.scan(chunk_step, initial_state, xs)      # o: [n, b, h, c, dv]
  return jnp.moveaxis(o, 0, 2), s


def chunk_gated_delta_xla(q, k, v, g, beta, *, initial_state=None, chunk_size=64, scale=None):
  """Chunked gated delta rule (see module docstring); the CPU fast path.

  Args:
    q, k: [batch, seq, heads, dk].
    v: [batch, seq, heads, dv].
    g: [batch, seq, heads] (GDN) or [batch, seq, heads, dk] (KDA), log decay <= 0.
    beta: [batch, seq, heads].
    initial_state: [batch, heads, dk, dv] or None (zeros).
    chunk_size: tokens per chunk; seq needs not be a multiple (padded inside).
    scale: query scale, default dk**-0.5.

  Returns:
    (o [batch, seq, heads, dv] in q.dtype, final_state [batch, heads, dk, dv] f32).
  """
  b, t, h, dk, dv, _ = check_chunk_inputs(q, k, v, g, beta, initial_state)
  require(chunk_size >= 1, f"chunk_size must be positive, got {chunk_size}")
  scale = dk ** -0.5 if scale is None else scale
  prep = chunk_prepare(q, k, v, g, beta, chunk_size=chunk_size, scale=scale)
  s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  o, s = chunk_recurrence_xla(prep, s0)
  return unchunk(o, t).astype(q.dtype), s


def unchunk(o, t):
  """[b, h, n, C, dv] -> [b, t, h, dv] (dropping the right padding)."""
  b, h, n, c, dv = o.shape
  return jnp.transpose(o, (0, 2, 3, 1, 4)).reshape(b, n * c, h, dv)[:, :t]
