"""The decode pool's device state and its jitted steps (paged KV + slot-indexed state).

The decode pool (``SlotPool``) keeps full-attention KV (``A``) and MLA latents
(``M``) in a shared **page pool** addressed through per-slot page tables (read
by ``pallas_kernels.paged_attention``), and keeps fixed-size state (sliding
window ring buffers ``S``, recurrent states ``G``/``m``) in **slot-indexed**
arrays. Everything is a pytree of fixed shape, so the decode step compiles
once for the pool size. ``PageAllocator`` is the host-side free list of pages;
``insert_core`` / ``generate_core`` (``generate_steps_core``: several steps per
call) / ``free_core`` are the jitted pool updates
``DecodeEngine`` (``decode_engine.py``) drives.

Token exactness: sampling is keyed by ``(seed, absolute position)`` with the
same ``sample_tokens`` as ``api.generate``, so a request produces the tokens of
single-process generation whatever batch it runs in.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from paas_jax.models import api, paged_decode
from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import PagedKV, PagedLatent, kind_spec
from paas_jax.serving.validation import EngineError
from paas_jax.state import init_state


class PoolExhaustedError(EngineError):
  """No slot or not enough pages right now (retry later or queue)."""



@struct.dataclass
class SlotPool:
  """The decode engine's whole device state (JetStream's ``decode_state``).

  Attributes:
    layers: per layer a ``PagedKV``/``PagedLatent`` (page pool) or a slot-indexed
      ``SlidingWindowCache``/``GatedDeltaCache``/``Mamba2Cache`` ``[n_slots, ...]``.
    lengths: int32 [n_slots], tokens in the cache of each slot.
    page_table: int32 [n_slots, max_pages]; page ids owned by each slot. Entries
      past a slot's pages hold 0: a valid page (so a kernel may read it safely)
      whose keys lie past the slot's length and are masked; writes never go
      there because a slot only writes positions it reserved.
    page_count: int32 [n_slots], pages owned by each slot (writes past them drop).
    tokens: int32 [n_slots], the next input token of each slot (last sampled).
    active: bool [n_slots].
    seeds (uint32), temperature, top_k, top_p: per-slot sampling settings.
  """

  layers: tuple
  lengths: jax.Array
  page_table: jax.Array
  page_count: jax.Array
  tokens: jax.Array
  active: jax.Array
  seeds: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array


class PageAllocator:
  """Free list of KV pages (host side)."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise PoolExhaustedError(f"need {n} KV pages, {len(self._free)} free")
    return [self._free.pop() for _ in range(n)]

  def release(self, pages: Sequence[int]) -> None:
    self._free.extend(reversed(list(pages)))


def generate_step(model, pool: SlotPool, sampler=api.sample_tokens):
  """One decode step of every slot of ``pool`` with the merged ``model`` (traced
  inside ``generate_core`` / ``generate_steps_core``; ``sampler``: a function
  like ``api.sample_tokens``): (new pool, int32 [n_slots] sampled tokens, f32
  [n_slots, vocab] logits)."""
  lengths, active = pool.lengths, pool.active
  # The block loop is the model's (models/paged_decode.py); the pool, sampling
  # and slot bookkeeping are the engine's.
  logits, layers = paged_decode.paged_step(model, pool.tokens, pool.layers, lengths,
                                           pool.page_table, pool.page_count, active)
  positions = lengths + 1
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(pool.seeds, positions)
  tokens = sampler(logits, keys, pool.temperature, pool.top_k, pool.top_p)
  tokens = jnp.where(active, tokens, 0)
  new_pool = pool.replace(layers=tuple(layers), lengths=jnp.where(active, positions, lengths),
                          tokens=tokens)
  return new_pool, tokens, logits


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def generate_core(graph, params, pool: SlotPool):
  """One decode step of every slot.

  Returns (new pool, int32 [n_slots] sampled tokens (0 for inactive slots),
  f32 [n_slots, vocab] the logits they were sampled from). The logits stay on
  the device; ``token_logprob_ops`` reads them only for requests that asked
  for logprobs.
  """
  return generate_step(nnx.merge(api.graphdef_of(graph), params), pool)


@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=2)
def generate_steps_core(graph, params, pool: SlotPool, steps: int):
  """``steps`` decode steps of every slot in one call (``lax.scan`` of the same
  step: each step feeds the previous one's sampled tokens), so the host waits
  once per ``steps`` tokens instead of once per token.

  A slot keeps decoding to the end of the window whatever it samples: the
  caller bounds ``steps`` by the tokens every active request may still
  produce (so no slot writes past its reserved pages) and drops what a
  request sampled after its stop token.

  Returns (new pool, int32 [steps, n_slots] sampled tokens, step major).
  """
  model = nnx.merge(api.graphdef_of(graph), params)

  def body(p, _):
    p, tokens, _ = generate_step(model, p)
    return p, tokens
  return jax.lax.scan(body, pool, None, length=steps)


@functools.partial(jax.jit, donate_argnums=0)
def insert_core(pool: SlotPool, prefix_layers: tuple, length, slot, page_row, write_row, token,
                 seed, temperature, top_k, top_p):
  """Writes one request into ``slot``.

  ``page_row`` [max_pages]: the slot's pages, ``num_pages`` past them (the
  page table row). ``write_row`` [n_write]: the pages written, the slot's
  pages then ``num_pages`` (dropped); growing caches arrive as
  [1, n_write * page_size, ...], so the work follows the request's pages,
  not the pool's max context.
  """
  layers = []
  for cache, src in zip(pool.layers, prefix_layers):
    if isinstance(cache, (PagedKV, PagedLatent)):
      ps = jax.tree_util.tree_leaves(cache)[0].shape[1]

      def put(pages, x):
        x = x[0].reshape((write_row.shape[0], ps) + x.shape[2:])
        return pages.at[write_row].set(x.astype(pages.dtype), mode="drop")
      dst_leaves, treedef = jax.tree_util.tree_flatten(cache)
      src_leaves = jax.tree_util.tree_leaves(src)
      layers.append(jax.tree_util.tree_unflatten(
          treedef, [put(d, x) for d, x in zip(dst_leaves, src_leaves)]))
    else:
      layers.append(jax.tree_util.tree_map(
          lambda dst, x: dst.at[slot].set(x[0].astype(dst.dtype)), cache, src))
  return pool.replace(
      layers=tuple(layers), lengths=pool.lengths.at[slot].set(length),
      page_table=pool.page_table.at[slot].set(jnp.where(page_row < num_pages_of(pool),
                                                         page_row, 0)),
      page_count=pool.page_count.at[slot].set(jnp.sum(page_row < num_pages_of(pool))),
      tokens=pool.tokens.at[slot].set(token),
      active=pool.active.at[slot].set(True), seeds=pool.seeds.at[slot].set(seed),
      temperature=pool.temperature.at[slot].set(temperature),
      top_k=pool.top_k.at[slot].set(top_k), top_p=pool.top_p.at[slot].set(top_p))


def num_pages_of(pool: SlotPool) -> int:
  for cache in pool.layers:
    if isinstance(cache, (PagedKV, PagedLatent)):
      return jax.tree_util.tree_leaves(cache)[0].shape[0]
  return 0


@functools.partial(jax.jit, donate_argnums=0)
def free_core(pool: SlotPool, slot, empty_row):
  return pool.replace(active=pool.active.at[slot].set(False),
                      lengths=pool.lengths.at[slot].set(0),
                      page_table=pool.page_table.at[slot].set(empty_row),
                      page_count=pool.page_count.at[slot].set(0),
                      tokens=pool.tokens.at[slot].set(0))


def init_pool(config: ModelConfig, n_slots: int, num_pages: int, page_size: int,
              max_pages: int) -> SlotPool:
  """An empty pool: zero pages, zero slot states, all slots inactive."""
  dense = init_state(config, n_slots, 0)
  layers = []
  for kind, cache in zip(config.layer_kinds, dense.layers):
    paged = kind_spec(kind).paged
    layers.append(cache if paged is None else paged.pool_type(**{
        name: jnp.zeros(shape, dtype)
        for name, (shape, dtype) in paged.pool_shapes(config, num_pages, page_size).items()}))
  return SlotPool(
      layers=tuple(layers), lengths=jnp.zeros((n_slots,), jnp.int32),
      page_table=jnp.zeros((n_slots, max_pages), jnp.int32),
      page_count=jnp.zeros((n_slots,), jnp.int32),
      tokens=jnp.zeros((n_slots,), jnp.int32), active=jnp.zeros((n_slots,), bool),
      seeds=jnp.zeros((n_slots,), jnp.uint32), temperature=jnp.zeros((n_slots,), jnp.float32),
      top_k=jnp.zeros((n_slots,), jnp.int32), top_p=jnp.ones((n_slots,), jnp.float32))

