"""Sizes of the serving engines (``PrefillEngine``, ``DecodeEngine``): one frozen config."""

from __future__ import annotations

import dataclasses

from paas_jax.state import CAPACITY_ALIGN


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes of the prefill and decode engines.

  Attributes:
    n_slots: decode slots (requests decoded together in one step).
    max_ctx: longest context (prompt + generated) a slot holds; 0 means the
      model's ``max_seq_len``. Rounded up to a whole number of pages.
    page_size: positions per KV page.
    num_pages: pages in the shared pool; 0 means enough for every slot to hold
      ``max_ctx`` (no oversubscription). Smaller pools admit fewer long requests.
    prefill_buckets: padded chunk lengths prefill compiles for (increasing
      multiples of 64); the largest is the chunk length: longer prompts are
      prefilled in several chunks.
    prefill_max_batch: prompts prefilled together; batches are padded to this
      many rows so that one compilation per bucket serves every batch.
    decode_steps_per_sync: most decode steps the scheduler runs in one device
      call (``DecodeEngine.generate_steps``) while no ready request waits for a
      free slot and none asks for logprobs; bounded by the tokens every active
      request may still produce and rounded down to a power of two (a handful
      of compiles). 1: one host round trip per token.
  """

  n_slots: int = 8
  max_ctx: int = 0
  page_size: int = 16
  num_pages: int = 0
  prefill_buckets: tuple[int, ...] = (64, 256)
  prefill_max_batch: int = 4
  # Hybrid prefix cache (``HybridPrefixCache``): block size in tokens, 0 = off.
  # With it on, prompts are prefilled one at a time by ``api.cached_prefill``.
  prefix_block: int = 0
  prefix_cache_bytes: int = 256 << 20
  decode_steps_per_sync: int = 1

  def __post_init__(self):
    if self.n_slots < 1:
      raise ValueError(f"EngineConfig.n_slots must be >= 1, got {self.n_slots}")
    if self.page_size < 1:
      raise ValueError(f"EngineConfig.page_size must be >= 1, got {self.page_size}")
    b = tuple(self.prefill_buckets)
    if not b or any(x < CAPACITY_ALIGN or x % CAPACITY_ALIGN for x in b) or list(b) != sorted(
        set(b)):
      raise ValueError(f"EngineConfig.prefill_buckets must be increasing multiples of "
                       f"{CAPACITY_ALIGN}, got {b}")
    if self.prefill_max_batch < 1:
      raise ValueError("EngineConfig.prefill_max_batch must be >= 1")
    if self.max_ctx < 0 or self.num_pages < 0:
      raise ValueError("EngineConfig.max_ctx and num_pages must be >= 0")
    if self.prefix_block < 0 or self.prefix_cache_bytes <= 0:
      raise ValueError("EngineConfig.prefix_block must be >= 0 and prefix_cache_bytes > 0")
    if self.decode_steps_per_sync < 1:
      raise ValueError(f"EngineConfig.decode_steps_per_sync must be >= 1, got "
                       f"{self.decode_steps_per_sync}")

  @property
  def prefill_chunk(self) -> int:
    return self.prefill_buckets[-1]

