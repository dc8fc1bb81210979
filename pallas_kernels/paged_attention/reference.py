"""Decode attention over a paged KV cache: references (gather + dense softmax).

Sequence b owns pages ``page_table[b, :]``; logical key position p lives in page
``page_table[b, p // page_size]`` at row ``p % page_size``. ``lengths[b]`` counts
the keys including the n new query tokens, so query i sits at position
``lengths[b] - n + i`` and sees keys at positions <= its own (and, with a
window, positions > its own - window). Entries of the page table past a
sequence's last page may hold anything (they are never read as visible keys).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._common import HIGHEST, require
from pallas_kernels.flash_attention.reference import attention_reference


def check_paged_inputs(q, k_pages, v_pages, lengths, page_table):
  """Validates shapes; returns (b, n, hq, d, num_pages, page_size, hkv, dv, max_pages)."""
  require(q.ndim == 4, f"q must be [batch, n, hq, d], got {q.shape}")
  b, n, hq, d = q.shape
  require(k_pages.ndim == 4 and k_pages.shape[-1] == d,
          f"k_pages must be [pages, page_size, hkv, {d}], got {k_pages.shape}")
  num_pages, page_size, hkv, _ = k_pages.shape
  require(v_pages.ndim == 4 and v_pages.shape[:3] == (num_pages, page_size, hkv),
          f"v_pages must be [{num_pages}, {page_size}, {hkv}, dv], got {v_pages.shape}")
  require(hq % hkv == 0, f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
  require(lengths.shape == (b,), f"lengths must be {(b,)}, got {lengths.shape}")
  require(page_table.ndim == 2 and page_table.shape[0] == b,
          f"page_table must be [{b}, max_pages], got {page_table.shape}")
  return b, n, hq, d, num_pages, page_size, hkv, v_pages.shape[-1], page_table.shape[1]


def check_mla_inputs(q_latent, q_rope, latent_pages, rope_pages, lengths, page_table):
  """Validates shapes; returns (b, n, h, r, dr, num_pages, page_size, max_pages)."""
  require(q_latent.ndim == 4, f"q_latent must be [batch, n, heads, r], got {q_latent.shape}")
  b, n, h, r = q_latent.shape
  require(q_rope.ndim == 4 and q_rope.shape[:3] == (b, n, h),
          f"q_rope must be [{b}, {n}, {h}, dr], got {q_rope.shape}")
  dr = q_rope.shape[-1]
  require(latent_pages.ndim == 3 and latent_pages.shape[-1] == r,
          f"latent_pages must be [pages, page_size, {r}], got {latent_pages.shape}")
  num_pages, page_size, _ = latent_pages.shape
  require(rope_pages.shape == (num_pages, page_size, dr),
          f"rope_pages must be {(num_pages, page_size, dr)}, got {rope_pages.shape}")
  require(lengths.shape == (b,), f"lengths must be {(b,)}, got {lengths.shape}")
  require(page_table.ndim == 2 and page_table.shape[0] == b,
          f"page_table must be [{b}, max_pages], got {page_table.shape}")
  return b, n, h, r, dr, num_pages, page_size, page_table.shape[1]


def gather_pages(pages, page_table):
  """[P, ps, ...] pages and [b, max_pages] table -> [b, max_pages * ps, ...] contiguous."""
  b, max_pages = page_table.shape
  ps = pages.shape[1]
  # Out-of-range table entries belong to unused tail slots; clamp so the
  # gather is defined (their keys are masked out by position).
  idx = jnp.clip(page_table, 0, pages.shape[0] - 1)
  g = pages[idx]                                        # [b, max_pages, ps, ...]
  return g.reshape(b, max_pages * ps, *pages.shape[2:])


def paged_positions(lengths, n, max_keys):
  """(q_positions [b, n], kv_positions [b, max_keys]) with -1 beyond each length."""
  q_pos = lengths[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None, :]
  kv = jnp.arange(max_keys, dtype=jnp.int32)[None, :]
  kv_pos = jnp.where(kv < lengths[:, None], kv, -1)
  return q_pos.astype(jnp.int32), kv_pos


def paged_attention_reference(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                              window=None):
  """Gathers every sequence's pages and runs dense masked attention.

  Args:
    q: [batch, n, hq, d] new query tokens.
    k_pages: [num_pages, page_size, hkv, d].
    v_pages: [num_pages, page_size, hkv, dv].
    lengths: [batch] int32 keys per sequence, including the n new tokens.
    page_table: [batch, max_pages] int32.
    sm_scale: default d**-0.5.
    window: sliding window or None.

  Returns:
    [batch, n, hq, dv] in q.dtype.
  """
  _, n, _, _, _, ps, _, _, max_pages = check_paged_inputs(q, k_pages, v_pages, lengths, page_table)
  k = gather_pages(k_pages, page_table)
  v = gather_pages(v_pages, page_table)
  q_pos, kv_pos = paged_positions(lengths.astype(jnp.int32), n, max_pages * ps)
  return attention_reference(q, k, v, q_positions=q_pos, kv_positions=kv_pos, window=window,
                             sm_scale=sm_scale)


def paged_mla_reference(q_latent, q_rope, latent_pages, rope_pages, lengths, page_table, *,
                        sm_scale):
  """Absorbed multi-head latent attention over paged latent / rope-key caches.

  scores[b,i,h,j] = sm_scale * (q_latent[b,i,h] . latent[b,j] + q_rope[b,i,h] . k_rope[b,j]);
  the output is softmax(scores) @ latent, i.e. still in latent space.

  Args:
    q_latent: [batch, n, heads, r] (queries already absorbed into latent space).
    q_rope: [batch, n, heads, dr].
    latent_pages: [num_pages, page_size, r].
    rope_pages: [num_pages, page_size, dr].
    lengths: [batch] int32, page_table: [batch, max_pages] int32 (as paged_attention).
    sm_scale: softmax scale (from the un-absorbed head dim, so no default).

  Returns:
    [batch, n, heads, r] in q_latent.dtype.
  """
  _, n, _, _, _, _, ps, max_pages = check_mla_inputs(q_latent, q_rope, latent_pages, rope_pages,
                                                      lengths, page_table)
  f32 = jnp.float32
  lat = gather_pages(latent_pages, page_table).astype(f32)   # [b, s, r]
  rope = gather_pages(rope_pages, page_table).astype(f32)    # [b, s, dr]
  q_pos, kv_pos = paged_positions(lengths.astype(jnp.int32), n, max_pages * ps)
  scores = (jnp.einsum("bnhr,bsr->bhns", q_latent.astype(f32), lat, precision=HIGHEST)
            + jnp.einsum("bnhr,bsr->bhns", q_rope.astype(f32), rope, precision=HIGHEST))
  scores = scores * sm_scale
  mask = ((kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None]))[:, None]
  scores = jnp.where(mask, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhns,bsr->bnhr", p / jnp.where(l > 0, l, 1.0), lat, precision=HIGHEST)
  return o.astype(q_latent.dtype)
