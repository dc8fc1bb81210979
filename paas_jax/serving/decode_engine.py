"""The decode engine: a continuous-batching pool of decode slots (JetStream's boundary).

* ``DecodeEngine.insert(prefix, slot)`` places one prefilled batch-1 state
  (``PrefillEngine``'s output) into a slot of the decode pool;
* ``DecodeEngine.generate()`` runs one decode step for every slot and returns
  one sampled token per slot; ``generate_steps(k)`` runs k steps in one device
  call (one host round trip per k tokens);
* ``DecodeEngine.free(slot)`` releases the slot and its pages;
* ``DecodeEngine.step_logprobs(tops)`` the last step's token log-probabilities
  of the slots whose requests asked for them (``logprobs.py``).

The pool's layout and jitted steps live in ``slot_pool.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models import api
from paas_jax.models.kinds import kind_spec
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.logprobs import TokenLogprob
from paas_jax.serving.slot_pool import (PageAllocator, PoolExhaustedError, free_core,
                                        generate_core, generate_steps_core, init_pool,
                                        insert_core)
from paas_jax.serving.token_logprob_ops import rows_logprobs
from paas_jax.serving.validation import EngineError, InvalidRequestError, RequestParams
from paas_jax.state import CAPACITY_ALIGN, AttentionCache, DecodeState, MLACache, init_state


class DecodeEngine:
  """A fixed pool of decode slots over a paged KV pool.

  Not thread-safe: one scheduler thread owns it (``DecodeScheduler``).
  """

  def __init__(self, model: api.Model, config: EngineConfig = EngineConfig()):
    self.model = model
    self.config = config
    mc = model.config
    max_ctx = min(config.max_ctx or mc.max_seq_len, mc.max_seq_len)
    self.page_size = config.page_size
    self.max_pages = -(-max_ctx // config.page_size)
    self.max_ctx = self.max_pages * config.page_size
    self.num_pages = config.num_pages or config.n_slots * self.max_pages
    self.n_slots = config.n_slots
    self.has_pages = any(kind_spec(k).paged is not None for k in mc.layer_kinds)
    self.pool = init_pool(mc, self.n_slots, self.num_pages, self.page_size, self.max_pages)
    self.allocator = PageAllocator(self.num_pages)
    self._slot_pages: dict[int, list[int]] = {}
    self._free_slots = list(range(self.n_slots - 1, -1, -1))
    self._empty_row = jnp.zeros((self.max_pages,), jnp.int32)
    # The last step's logits (f32 [n_slots, vocab], device) and tokens (host).
    self._last_logits = None
    self._last_tokens = None

  # -- capacity --------------------------------------------------------------------

  @property
  def free_slots(self) -> int:
    return len(self._free_slots)

  @property
  def free_pages(self) -> int:
    return self.allocator.free_pages

  def pages_needed(self, total_tokens: int) -> int:
    return -(-total_tokens // self.page_size) if self.has_pages else 0

  def can_admit(self, total_tokens: int) -> bool:
    return bool(self._free_slots) and self.pages_needed(total_tokens) <= self.free_pages

  def fits_ever(self, total_tokens: int) -> bool:
    return total_tokens <= self.max_ctx and self.pages_needed(total_tokens) <= self.num_pages

  def reserve(self, total_tokens: int) -> int:
    """Takes a free slot and the pages for ``total_tokens`` positions; returns the slot."""
    if not self.fits_ever(total_tokens):
      raise InvalidRequestError(f"a request of {total_tokens} tokens (prompt + new) does not "
                                f"fit a decode slot of {self.max_ctx} tokens")
    if not self._free_slots:
      raise PoolExhaustedError("no free decode slot")
    pages = self.allocator.alloc(self.pages_needed(total_tokens))
    slot = self._free_slots.pop()
    self._slot_pages[slot] = pages
    return slot

  # -- JetStream boundary ----------------------------------------------------------

  def insert(self, prefix: DecodeState, slot: int, first_token: int,
             params: RequestParams) -> None:
    """Places a batch-1 prefilled state into a reserved ``slot``.

    ``first_token`` (sampled from the prefill logits) is the slot's next input.
    """
    if slot not in self._slot_pages:
      raise EngineError(f"slot {slot} was not reserved")
    length = int(np.asarray(prefix.lengths).reshape(-1)[0])
    pages = self._slot_pages[slot]
    if self.has_pages and len(pages) * self.page_size < length + 1:
      raise EngineError(f"slot {slot} holds {len(pages) * self.page_size} positions, "
                        f"the state has {length}")
    row = np.full((self.max_pages,), self.num_pages, np.int32)
    row[:len(pages)] = pages
    # Only the slot's own pages are written, their count bucketed to a power
    # of two (a handful of insert compiles), so the cost follows the request.
    n_write = min(self.max_pages, 1 << max(len(pages) - 1, 0).bit_length())
    write_row = row[:n_write]
    src = tuple(self._pad_layer(c, n_write * self.page_size) for c in prefix.layers)
    s = params.sampling
    self.pool = insert_core(self.pool, src, jnp.int32(length), jnp.int32(slot),
                             jnp.asarray(row), jnp.asarray(write_row), jnp.int32(first_token),
                             jnp.uint32(params.seed),
                             jnp.float32(s.temperature), jnp.int32(s.top_k),
                             jnp.float32(s.top_p))

  def _pad_layer(self, cache, positions: int):
    """Growing caches padded/cut to ``positions`` (the pages written)."""
    if not isinstance(cache, (AttentionCache, MLACache)):
      return cache

    def fit(x):
      x = np.asarray(x)
      out = np.zeros((1, positions) + x.shape[2:], x.dtype)
      n = min(x.shape[1], positions)
      out[:, :n] = x[:, :n]
      return out
    return jax.tree_util.tree_map(fit, cache)

  def generate(self) -> np.ndarray:
    """One decode step for every slot; returns int32 [n_slots] (0 for empty slots)."""
    # The pre-hashed graph: hashing a whole GraphDef per step costs ms.
    self.pool, tokens, self._last_logits = generate_core(self.model.static_graph,
                                                         self.model.params, self.pool)
    self._last_tokens = np.asarray(tokens)
    return self._last_tokens

  def generate_steps(self, steps: int) -> np.ndarray:
    """``steps`` decode steps of every slot in one device call (``generate_steps_core``).

    The caller bounds ``steps`` by the tokens each active request may still
    produce (its slot keeps decoding to the end of the window) and drops
    tokens sampled after a request's stop token. No logits are kept: a
    request that asks for logprobs is decoded by ``generate``.

    Returns:
      int32 [steps, n_slots], step major (0 for empty slots).
    """
    if steps < 1:
      raise EngineError(f"generate_steps takes steps >= 1, got {steps}")
    if steps == 1:
      return self.generate()[None]
    self.pool, tokens = generate_steps_core(self.model.static_graph, self.model.params,
                                            self.pool, steps)
    self._last_logits = self._last_tokens = None
    return np.asarray(tokens)

  def step_logprobs(self, tops: dict[int, int]) -> dict[int, TokenLogprob]:
    """Log-probabilities of the last ``generate`` step's tokens.

    Args:
      tops: slot -> top alternatives wanted (0..``MAX_TOP_LOGPROBS``).

    Returns:
      slot -> ``TokenLogprob``, computed on the device from the logits that
      step sampled from (one small op and one host transfer for all slots).
    """
    if not tops:
      return {}
    if self._last_logits is None:
      raise EngineError("no decode step ran yet")
    slots = sorted(tops)
    got = rows_logprobs(self._last_logits, self._last_tokens, slots, [tops[s] for s in slots])
    return dict(zip(slots, got))

  def free(self, slot: int) -> None:
    pages = self._slot_pages.pop(slot, None)
    if pages is None:
      return
    self.allocator.release(pages)
    self.pool = free_core(self.pool, jnp.int32(slot), self._empty_row)
    self._free_slots.append(slot)

  def warmup(self) -> float:
    """Compiles insert, generate and free; returns seconds spent."""
    t0 = time.perf_counter()
    slot = self.reserve(2)
    state = init_state(self.model.config, 1, CAPACITY_ALIGN)
    state = state.replace(lengths=jnp.ones((1,), jnp.int32))
    self.insert(state, slot, 0, RequestParams())
    self.generate()
    self.free(slot)
    self.generate()
    return time.perf_counter() - t0

