"""Softmax-attention mixers: full (``A``), sliding-window (``S``) and MLA (``M``).

Every mixer has two entry points that the tests hold equal:

* ``prefill(x, cache, chunk)`` processes a right-padded chunk of tokens that
  continues from what the cache already holds (chunked prefill);
* ``step(x, cache, lengths)`` processes one token per request (decode), for
  requests of different lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from pallas_kernels.flash_attention.ops import flash_attention
from pallas_kernels.paged_attention.ops import paged_attention, paged_mla_attention
from paas_jax.models.config import ModelConfig
from paas_jax.models.layers import apply_rope, dense, make_norm


# -- caches (one per attention kind; the decode state holds one per layer) ----------

@struct.dataclass
class AttentionCache:
  """Full-attention KV. ``k``: [batch, capacity, kv_heads, head_dim]; ``v`` likewise.

  Position ``p`` of a request lives at index ``p``.
  """

  k: jax.Array
  v: jax.Array


@struct.dataclass
class SlidingWindowCache:
  """Ring buffer of the last ``window`` positions: ``k``, ``v``
  [batch, window, kv_heads, head_dim]; position ``p`` lives at ``p % window``."""

  k: jax.Array
  v: jax.Array


@struct.dataclass
class MLACache:
  """MLA cache: ``latent`` [batch, capacity, kv_lora_rank] (normalised KV latent)
  and ``k_rope`` [batch, capacity, qk_rope_head_dim] (rotated, shared by heads)."""

  latent: jax.Array
  k_rope: jax.Array


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Where a prefill chunk sits in each request.

  Attributes:
    start: int32 [batch], tokens already in the cache.
    n_valid: int32 [batch], real tokens in this chunk (the rest is padding).
    positions: int32 [batch, seq], ``start + arange(seq)``.
    valid: bool [batch, seq], ``arange(seq) < n_valid``.
  """

  start: jax.Array
  n_valid: jax.Array
  positions: jax.Array
  valid: jax.Array

  @classmethod
  def make(cls, start: jax.Array, n_valid: jax.Array, seq: int) -> "Chunk":
    offsets = jnp.arange(seq, dtype=jnp.int32)[None, :]
    return cls(start=start, n_valid=n_valid, positions=start[:, None] + offsets,
               valid=offsets < n_valid[:, None])


jax.tree_util.register_dataclass(
    Chunk, data_fields=["start", "n_valid", "positions", "valid"], meta_fields=[])


def _contiguous_pages(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Views a contiguous cache [batch, capacity, ...] as pages plus a page table.

  A dense per-request cache is the special case of a paged cache whose page
  table is ``arange``; decode then runs the same paged-attention op that the
  serving engine runs on its shared page pool.
  """
  batch, capacity = x.shape[:2]
  page = next(p for p in (64, 32, 16, 8, 4, 2, 1) if capacity % p == 0)
  n_pages = capacity // page
  pages = x.reshape((batch * n_pages, page) + x.shape[2:])
  table = jnp.arange(batch * n_pages, dtype=jnp.int32).reshape(batch, n_pages)
  return pages, table


def _write_pages(page_table: jax.Array, lengths: jax.Array, pages_shape) -> jax.Array:
  """Page that receives each request's next token; ``num_pages`` (dropped) when
  the request has run out of pages."""
  index = lengths // pages_shape[1]
  rows = jnp.arange(lengths.shape[0])
  page = page_table[rows, jnp.minimum(index, page_table.shape[1] - 1)]
  return jnp.where(index < page_table.shape[1], page, pages_shape[0])


def _write_tokens(cache_array: jax.Array, values: jax.Array, chunk: Chunk) -> jax.Array:
  """Scatters chunk values [batch, seq, ...] to their positions; padding is dropped."""
  capacity = cache_array.shape[1]
  index = jnp.where(chunk.valid, chunk.positions, capacity)  # out of range -> dropped
  rows = jnp.arange(values.shape[0])[:, None]
  return cache_array.at[rows, index].set(values.astype(cache_array.dtype), mode="drop")


def _live_positions(capacity: int, lengths: jax.Array) -> jax.Array:
  """Positions of cache slots [batch, capacity]; -1 marks empty slots."""
  slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  return jnp.where(slots < lengths[:, None], slots, -1)


def _ring_positions(window: int, lengths: jax.Array) -> jax.Array:
  """Token position held by each ring-buffer slot [batch, window]; -1 if empty.

  After ``L`` tokens, slot ``s`` holds the latest position ``p < L`` with
  ``p % window == s``.
  """
  slots = jnp.arange(window, dtype=jnp.int32)[None, :]
  last = lengths[:, None] - 1
  pos = last - jnp.mod(last - slots, window)
  return jnp.where(pos >= 0, pos, -1)


class Attention(nnx.Module):
  """GQA/MQA attention with RoPE, optional QK-norm and sigmoid output gate.

  With the output gate, ``q_proj`` yields per head the query followed by its
  gate (``[q_0, g_0, q_1, g_1, ...]``), Qwen3-Next's layout.

  With ``window`` set it is a sliding-window layer (``S``) whose cache is a
  ring buffer of ``window`` positions; otherwise a full-attention layer (``A``).
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, window: int | None = None):
    a = config.attention
    self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
    self.head_dim = config.attention_head_dim
    self.rot_dim = int(self.head_dim * a.rope_fraction)
    self.rope_theta = a.rope_theta
    self.use_rope = a.use_rope
    self.output_gate = a.output_gate
    self.window = window
    self.impl = "auto"  # kernel implementation (pallas_kernels impl names)
    q_width = self.n_heads * self.head_dim * (2 if a.output_gate else 1)
    kv_width = self.n_kv_heads * self.head_dim
    self.q_proj = dense(config.d_model, q_width, config, rngs, use_bias=a.bias)
    self.k_proj = dense(config.d_model, kv_width, config, rngs, use_bias=a.bias)
    self.v_proj = dense(config.d_model, kv_width, config, rngs, use_bias=a.bias)
    self.o_proj = dense(self.n_heads * self.head_dim, config.d_model, config, rngs,
                        use_bias=a.bias)
    if a.qk_norm:
      self.q_norm = make_norm(self.head_dim, config)
      self.k_norm = make_norm(self.head_dim, config)
    else:
      self.q_norm = self.k_norm = None

  def _project(self, x: jax.Array, positions: jax.Array):
    """x [b, t, d] -> q [b,t,hq,hd], k/v [b,t,hkv,hd], gate [b,t,hq,hd] | None."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.n_heads, -1)
    gate = None
    if self.output_gate:
      q, gate = jnp.split(q, 2, axis=-1)
    k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.use_rope:
      q = apply_rope(q, positions, self.rot_dim, self.rope_theta)
      k = apply_rope(k, positions, self.rot_dim, self.rope_theta)
    return q, k, v, gate

  def _output(self, o: jax.Array, gate: jax.Array | None) -> jax.Array:
    if gate is not None:
      o = o * jax.nn.sigmoid(gate)
    b, t = o.shape[:2]
    return self.o_proj(o.reshape(b, t, -1))

  def prefill(self, x: jax.Array, cache, chunk: Chunk):
    q, k, v, gate = self._project(x, chunk.positions)
    kv_positions_new = jnp.where(chunk.valid, chunk.positions, -1)
    if self.window is None:
      k_all = _write_tokens(cache.k, k, chunk)
      v_all = _write_tokens(cache.v, v, chunk)
      live = _live_positions(k_all.shape[1], chunk.start + chunk.n_valid)
      o = flash_attention(q, k_all, v_all, q_positions=chunk.positions, kv_positions=live,
                          impl=self.impl)
      return self._output(o, gate), AttentionCache(k=k_all, v=v_all)

    # Sliding window: attend over the ring (older tokens) plus this chunk.
    ring_pos = _ring_positions(self.window, chunk.start)
    keys = jnp.concatenate([cache.k.astype(k.dtype), k], axis=1)
    values = jnp.concatenate([cache.v.astype(v.dtype), v], axis=1)
    kv_pos = jnp.concatenate([ring_pos, kv_positions_new], axis=1)
    o = flash_attention(q, keys, values, q_positions=chunk.positions,
                        kv_positions=kv_pos, window=self.window, impl=self.impl)
    # Only the last `window` valid tokens of the chunk survive in the ring;
    # writing just those keeps the scatter free of duplicate slots.
    offsets = jnp.arange(x.shape[1])[None, :]
    keep = chunk.valid & (offsets >= chunk.n_valid[:, None] - self.window)
    slot = jnp.where(keep, jnp.mod(chunk.positions, self.window), self.window)
    rows = jnp.arange(x.shape[0])[:, None]
    new_k = cache.k.at[rows, slot].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[rows, slot].set(v.astype(cache.v.dtype), mode="drop")
    return self._output(o, gate), SlidingWindowCache(k=new_k, v=new_v)

  def step(self, x: jax.Array, cache, lengths: jax.Array):
    """x [b, d]; the new token of request i sits at position ``lengths[i]``."""
    if self.window is None:
      k_pages, table = _contiguous_pages(cache.k)
      v_pages, _ = _contiguous_pages(cache.v)
      out, k_pages, v_pages = self.paged_step(x, k_pages, v_pages, lengths, table,
                                              _write_pages(table, lengths, k_pages.shape))
      return out, AttentionCache(k=k_pages.reshape(cache.k.shape),
                                 v=v_pages.reshape(cache.v.shape))
    positions = lengths[:, None]
    q, k, v, gate = self._project(x[:, None], positions)
    rows = jnp.arange(x.shape[0])
    slot = jnp.mod(lengths, self.window)
    new_k = cache.k.at[rows, slot].set(k[:, 0].astype(cache.k.dtype))
    new_v = cache.v.at[rows, slot].set(v[:, 0].astype(cache.v.dtype))
    kv_pos = _ring_positions(self.window, lengths + 1)
    o = flash_attention(q, new_k, new_v, q_positions=positions, kv_positions=kv_pos,
                        window=self.window, impl=self.impl)
    return self._output(o, gate)[:, 0], SlidingWindowCache(k=new_k, v=new_v)

  def paged_step(self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 lengths: jax.Array, page_table: jax.Array, write_page: jax.Array):
    """One decode token of full attention against a paged KV pool.

    Args:
      x: [b, d]; the new token of request i sits at position ``lengths[i]``.
      k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim].
      page_table: int32 [b, max_pages].
      write_page: int32 [b], page receiving the new token (out of range: dropped).

    Returns:
      (output [b, d], k_pages, v_pages with the new token written).
    """
    q, k, v, gate = self._project(x[:, None], lengths[:, None])
    offset = lengths % k_pages.shape[1]
    k_pages = k_pages.at[write_page, offset].set(k[:, 0].astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[write_page, offset].set(v[:, 0].astype(v_pages.dtype), mode="drop")
    o = paged_attention(q, k_pages, v_pages, lengths + 1, page_table, impl=self.impl)
    return self._output(o, gate)[:, 0], k_pages, v_pages


class MLAttention(nnx.Module):
  """Multi-head latent attention with a decoupled RoPE key.

  Prefill expands the cached latent into per-head keys and values; decode uses
  the absorbed form (queries mapped into latent space), so it reads only the
  latent cache, which is what makes MLA's KV small.
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    m = config.mla
    self.cfg = m
    self.impl = "auto"  # kernel implementation (pallas_kernels impl names)
    h, dn, dr, dv, r = (m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim,
                        m.v_head_dim, m.kv_lora_rank)
    latent_eps = config.norm_eps if m.latent_norm_eps is None else m.latent_norm_eps
    if m.q_lora_rank:
      self.q_a = dense(config.d_model, m.q_lora_rank, config, rngs, use_bias=m.bias)
      self.q_a_norm = make_norm(m.q_lora_rank, config, eps=latent_eps)
      self.q_b = dense(m.q_lora_rank, h * (dn + dr), config, rngs)
    else:
      self.q_a = self.q_a_norm = None
      self.q_b = dense(config.d_model, h * (dn + dr), config, rngs)
    self.kv_a = dense(config.d_model, r + dr, config, rngs, use_bias=m.bias)
    self.kv_a_norm = make_norm(r, config, eps=latent_eps)
    self.kv_b = dense(r, h * (dn + dv), config, rngs)
    self.o_proj = dense(h * dv, config.d_model, config, rngs, use_bias=m.bias)
    self.sm_scale = (dn + dr) ** -0.5

  def _queries(self, x: jax.Array, positions: jax.Array):
    m = self.cfg
    b, t, _ = x.shape
    q_in = self.q_a_norm(self.q_a(x)) if self.q_a is not None else x
    q = self.q_b(q_in).reshape(b, t, m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    if m.use_rope:
      q_rope = apply_rope(q_rope, positions, m.qk_rope_head_dim, m.rope_theta)
    return q_nope, q_rope

  def _latent(self, x: jax.Array, positions: jax.Array):
    """x [b,t,d] -> normalised latent [b,t,r] and shared key [b,t,dr] (rotated unless NoPE)."""
    m = self.cfg
    kv = self.kv_a(x)
    latent, k_rope = kv[..., :m.kv_lora_rank], kv[..., m.kv_lora_rank:]
    if m.use_rope:
      k_rope = apply_rope(k_rope, positions, m.qk_rope_head_dim, m.rope_theta)
    return self.kv_a_norm(latent), k_rope

  def _kv_b_heads(self, dtype):
    """kv_b kernel split per head: W_uk [r, h, dn], W_uv [r, h, dv]."""
    m = self.cfg
    w = self.kv_b.kernel[...].astype(dtype).reshape(
        m.kv_lora_rank, m.n_heads, m.qk_nope_head_dim + m.v_head_dim)
    return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]

  def prefill(self, x: jax.Array, cache: MLACache, chunk: Chunk):
    m = self.cfg
    b, t, _ = x.shape
    q_nope, q_rope = self._queries(x, chunk.positions)
    latent, k_rope = self._latent(x, chunk.positions)
    latent_all = _write_tokens(cache.latent, latent, chunk)
    rope_all = _write_tokens(cache.k_rope, k_rope, chunk)
    w_uk, w_uv = self._kv_b_heads(x.dtype)
    lat = latent_all.astype(x.dtype)
    k_nope = jnp.einsum("bsr,rhn->bshn", lat, w_uk)
    v = jnp.einsum("bsr,rhv->bshv", lat, w_uv)
    k_shared = jnp.broadcast_to(rope_all.astype(x.dtype)[:, :, None, :],
                                k_nope.shape[:3] + (m.qk_rope_head_dim,))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_shared], axis=-1)
    live = _live_positions(latent_all.shape[1], chunk.start + chunk.n_valid)
    o = flash_attention(q, k, v, q_positions=chunk.positions, kv_positions=live,
                        sm_scale=self.sm_scale, impl=self.impl)
    out = self.o_proj(o.reshape(b, t, -1))
    return out, MLACache(latent=latent_all, k_rope=rope_all)

  def step(self, x: jax.Array, cache: MLACache, lengths: jax.Array):
    latent_pages, table = _contiguous_pages(cache.latent)
    rope_pages, _ = _contiguous_pages(cache.k_rope)
    out, latent_pages, rope_pages = self.paged_step(
        x, latent_pages, rope_pages, lengths, table,
        _write_pages(table, lengths, latent_pages.shape))
    return out, MLACache(latent=latent_pages.reshape(cache.latent.shape),
                         k_rope=rope_pages.reshape(cache.k_rope.shape))

  def paged_step(self, x: jax.Array, latent_pages: jax.Array, rope_pages: jax.Array,
                 lengths: jax.Array, page_table: jax.Array, write_page: jax.Array):
    """One decode token in absorbed form against a paged latent pool.

    Args:
      x: [b, d]; the new token of request i sits at position ``lengths[i]``.
      latent_pages: [num_pages, page_size, kv_lora_rank]; rope_pages:
        [num_pages, page_size, qk_rope_head_dim].
      page_table: int32 [b, max_pages].
      write_page: int32 [b], page receiving the new token (out of range: dropped).

    Returns:
      (output [b, d], latent_pages, rope_pages with the new token written).
    """
    positions = lengths[:, None]
    q_nope, q_rope = self._queries(x[:, None], positions)
    latent, k_rope = self._latent(x[:, None], positions)
    offset = lengths % latent_pages.shape[1]
    latent_pages = latent_pages.at[write_page, offset].set(
        latent[:, 0].astype(latent_pages.dtype), mode="drop")
    rope_pages = rope_pages.at[write_page, offset].set(
        k_rope[:, 0].astype(rope_pages.dtype), mode="drop")
    w_uk, w_uv = self._kv_b_heads(x.dtype)
    q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
    o_latent = paged_mla_attention(q_latent, q_rope, latent_pages, rope_pages,
                                   lengths + 1, page_table, sm_scale=self.sm_scale,
                                   impl=self.impl)
    o = jnp.einsum("bthr,rhv->bthv", o_latent.astype(x.dtype), w_uv)
    return self.o_proj(o.reshape(x.shape[0], -1)), latent_pages, rope_pages
