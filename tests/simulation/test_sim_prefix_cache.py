"""Hybrid prefix cache: block hashes + recurrent checkpoints + LRU."""

import pytest

from paas_jax.simulation.prefix_cache import CacheSpec, PrefixCache, TokenLayout

SPEC = CacheSpec(block_tokens=256, checkpoint_interval_tokens=4096, capacity_bytes=1e12)


def _cache(spec=SPEC):
  return PrefixCache(spec, kv_bytes_per_token=1000.0, state_bytes=1e6)


def test_usable_prefix_needs_a_checkpoint_inside_the_cached_blocks():
  c = _cache()
  c.insert(TokenLayout(0, 20_000, prefix_id=7, shared_tokens=10_000))
  # Blocks cover 39*256 = 9984 shared tokens; the last checkpoint inside is at 8192.
  assert c.match(TokenLayout(1, 30_000, prefix_id=7, shared_tokens=10_000)) == 8192
  # A request sharing only 5000 tokens can resume at 4096.
  assert c.match(TokenLayout(2, 30_000, prefix_id=7, shared_tokens=5_000)) == 4096
  # Different prefix or no prefix: nothing.
  assert c.match(TokenLayout(3, 30_000, prefix_id=8, shared_tokens=10_000)) == 0
  assert c.match(TokenLayout(4, 30_000, prefix_id=-1, shared_tokens=0)) == 0


def test_at_least_one_token_is_recomputed():
  c = _cache()
  c.insert(TokenLayout(0, 8192, prefix_id=1, shared_tokens=8192))
  assert c.match(TokenLayout(1, 8192, prefix_id=1, shared_tokens=8192)) == 4096


def test_kv_without_checkpoints_is_not_resumable():
  c = _cache()
  c.insert(TokenLayout(0, 20_000, prefix_id=7, shared_tokens=10_000), with_checkpoints=False)
  assert c.match(TokenLayout(1, 20_000, prefix_id=7, shared_tokens=10_000)) == 0


def test_lru_evicts_the_cold_prefix():
  # Capacity for one 8192-token prefix (32 blocks of 256 kB + 2 checkpoints) and a bit.
  spec = CacheSpec(block_tokens=256, checkpoint_interval_tokens=4096, capacity_bytes=1.2e7)
  c = _cache(spec)
  a = TokenLayout(0, 8200, prefix_id=1, shared_tokens=8192)
  b = TokenLayout(1, 8200, prefix_id=2, shared_tokens=8192)
  c.insert(a)
  assert c.match(TokenLayout(5, 9000, prefix_id=1, shared_tokens=8192)) == 8192
  c.insert(b)
  assert c.used_bytes <= spec.capacity_bytes and c.evictions > 0
  assert c.match(TokenLayout(6, 9000, prefix_id=1, shared_tokens=8192)) == 0
  assert c.match(TokenLayout(7, 9000, prefix_id=2, shared_tokens=8192)) == 8192


def test_zero_capacity_disables_caching_and_spec_validates():
  c = _cache(CacheSpec(capacity_bytes=0))
  c.insert(TokenLayout(0, 20_000, prefix_id=7, shared_tokens=10_000))
  assert len(c) == 0
  with pytest.raises(ValueError):
    CacheSpec(block_tokens=256, checkpoint_interval_tokens=1000)
  with pytest.raises(ValueError):
    TokenLayout(0, 10, prefix_id=-1, shared_tokens=5)
