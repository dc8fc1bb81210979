"""One decode step of a slot pool whose growing caches live in shared pages.

The serving decode pool (``serving/slot_pool.py``) keeps full-attention KV and
MLA latents in a page pool (``PagedKV``, ``PagedLatent``: ``[num_pages,
page_size, ...]``, addressed through per-slot page tables) and every other
layer's state slot-indexed (``[n_slots, ...]``). ``paged_step`` runs the
model's blocks over that layout: the paged layers through their mixer's
``paged_step``, the others through ``step``, each block finished by
``Block.feed_forward``. The block loop stays here, with the model, so serving
code never re-runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paas_jax.models.kinds import PAGED_CACHES


def keep_active(active: jax.Array, new, old):
  """Rows of inactive slots keep their old value (so empty slots stay inert).

  ``active``: bool [n_slots]; ``new``/``old``: pytrees of ``[n_slots, ...]`` arrays.
  """
  def sel(n, o):
    mask = active.reshape((-1,) + (1,) * (n.ndim - 1))
    return jnp.where(mask, n, o)
  return jax.tree_util.tree_map(sel, new, old)


def paged_step(model, tokens: jax.Array, layers: tuple, lengths: jax.Array,
               page_table: jax.Array, page_count: jax.Array, active: jax.Array
               ) -> tuple[jax.Array, tuple]:
  """One decode step of every slot of a pool.

  Args:
    model: the ``HybridLM`` (merged module).
    tokens: int32 [n_slots], each slot's next input token.
    layers: per layer a page pool (``PAGED_CACHES``) or a slot-indexed cache.
    lengths: int32 [n_slots], tokens already in each slot's cache (the new
      token's position).
    page_table: int32 [n_slots, max_pages], each slot's pages.
    page_count: int32 [n_slots], pages each slot owns; a write past them (or
      by an inactive slot) is dropped.
    active: bool [n_slots]; inactive slots keep their slot-indexed state.

  Returns:
    (f32 logits [n_slots, vocab], the new layers).
  """
  x = model.embed(tokens)
  new_layers = []
  for block, cache in zip(model.blocks, layers):
    h_in = block.mixer_norm(x)
    if isinstance(cache, PAGED_CACHES):
      ps = jax.tree_util.tree_leaves(cache)[0].shape[1]
      num_pages = jax.tree_util.tree_leaves(cache)[0].shape[0]
      rows = jnp.arange(lengths.shape[0])
      index = lengths // ps
      page = page_table[rows, jnp.minimum(index, page_table.shape[1] - 1)]
      owned = active & (index < page_count)
      write_page = jnp.where(owned, page, num_pages)  # out of range -> dropped
      h, *pages = block.mixer.paged_step(h_in, *jax.tree_util.tree_leaves(cache), lengths,
                                         page_table, write_page)
      new_cache = type(cache)(*pages)
    else:
      h, new_cache = block.mixer.step(h_in, cache, lengths)
      new_cache = keep_active(active, new_cache, cache)
    x = block.feed_forward(x + h)
    new_layers.append(new_cache)
  return model.logits(x), tuple(new_layers)
