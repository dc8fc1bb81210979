"""Hybrid prefix cache: exact reuse, block/checkpoint rules, release, eviction."""

import numpy as np
import pytest

from paas_jax.models import api, load_config
from paas_jax.state import HybridPrefixCache
from tests.models.conftest import get_model

BLOCK = 16


@pytest.mark.parametrize("name", ["test_mixed", "tiny_kda_mla"])
def test_reused_prefix_gives_same_logits_and_decode(name):
  model = get_model(name)
  rng = np.random.RandomState(0)
  shared = rng.randint(0, model.config.vocab_size, size=2 * BLOCK + 5).tolist()
  first = shared + rng.randint(0, model.config.vocab_size, size=7).tolist()
  second = shared + rng.randint(0, model.config.vocab_size, size=11).tolist()
  cache = HybridPrefixCache(model.config, block_size=BLOCK)

  _, _, reused = api.cached_prefill(model, first, cache)
  assert reused == 0
  logits, state, reused = api.cached_prefill(model, second, cache)
  assert reused == 2 * BLOCK  # the third shared block is incomplete
  ref_logits, ref_state = api.prefill(model, np.asarray(second))
  np.testing.assert_allclose(logits, ref_logits[:, -1], atol=1e-4, rtol=0)
  for step in range(3):
    tok = np.array([step + 1])
    a, state = api.decode_step(model, state, tok)
    b, ref_state = api.decode_step(model, ref_state, tok)
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
  assert cache.stats.hits == 1 and cache.stats.hit_tokens == 2 * BLOCK


def test_match_needs_blocks_and_checkpoint_and_leaves_one_token():
  model = get_model("tiny_gdn_gqa")
  cache = HybridPrefixCache(model.config, block_size=BLOCK)
  prompt = list(range(1, 2 * BLOCK + 1))
  api.cached_prefill(model, prompt, cache)
  # Exactly two blocks were prefilled: a full match would leave nothing to run.
  assert cache.match_length(prompt) == BLOCK
  assert cache.match_length(prompt + [7]) == 2 * BLOCK
  # A different first block breaks the chain for everything after it.
  assert cache.match_length([0] + prompt[1:] + [7]) == 0


def test_state_from_plain_prefill_checkpoints_only_at_boundaries():
  model = get_model("tiny_gdn_gqa")
  cache = HybridPrefixCache(model.config, block_size=BLOCK)
  prompt = list(range(1, BLOCK + 6))
  _, state = api.prefill(model, np.asarray(prompt))
  cache.insert(prompt, state)
  # KV block 0 is stored but there is no recurrent checkpoint at 16 tokens.
  assert cache.stats.blocks == 1 and cache.stats.checkpoints == 0
  assert cache.match_length(prompt + [3]) == 0
  with pytest.raises(ValueError, match="holds"):
    cache.insert(prompt[:-1], state)


def test_release_drops_transfer_entries_and_eviction_respects_budget():
  model = get_model("tiny_kda_mla")
  cache = HybridPrefixCache(model.config, block_size=BLOCK)
  prompt = list(range(3, 3 + 3 * BLOCK + 1))
  api.cached_prefill(model, prompt, cache, owner="req-1")
  assert cache.stats.nbytes > 0
  freed = cache.release("req-1")
  assert freed > 0 and cache.stats.nbytes == 0 and cache.stats.blocks == 0

  small = HybridPrefixCache(model.config, block_size=BLOCK, capacity_bytes=60_000)
  api.cached_prefill(model, prompt, small)
  assert 0 < small.stats.nbytes <= 60_000


def test_hashes_depend_on_model_fingerprint():
  a = HybridPrefixCache(load_config("tiny_gdn_gqa"), block_size=4)
  b = HybridPrefixCache(load_config("tiny_dense_gqa"), block_size=4)
  assert a.block_hashes([1, 2, 3, 4]) != b.block_hashes([1, 2, 3, 4])
  assert len(a.block_hashes(list(range(11)))) == 2


def test_match_by_hashes_equals_match_by_ids_on_shared_prefixes():
  """``match_length_hashes`` over ``block_hashes(probe_tokens(p))`` (what the
  broker sends instead of the prompt) answers exactly ``match_length(p)``."""
  import dataclasses

  import jax.numpy as jnp

  from paas_jax.state import block_hashes, init_state, probe_tokens

  config = load_config("tiny_gdn_gqa")
  cache = HybridPrefixCache(config, block_size=BLOCK)
  rng = np.random.RandomState(3)
  roots = [rng.randint(0, config.vocab_size, size=6 * BLOCK).tolist() for _ in range(3)]
  # Cached entries: prefixes of the roots at block boundaries (checkpoints) and
  # off them (KV blocks only); the states are zeros, matching only reads keys.
  for root in roots:
    for length in rng.choice(np.arange(1, 5 * BLOCK), size=4, replace=False):
      state = init_state(config, 1, int(length) + BLOCK)
      state = dataclasses.replace(state, lengths=jnp.full((1,), int(length), jnp.int32))
      cache.insert(root[:int(length)], state)
  fp = config.fingerprint()
  hits = 0
  for _ in range(200):
    root = roots[rng.randint(len(roots))]
    cut = int(rng.randint(0, len(root) + 1))
    prompt = root[:cut] + rng.randint(0, config.vocab_size, size=rng.randint(0, 40)).tolist()
    if rng.rand() < 0.2 and prompt:  # a changed token breaks the chain from there
      prompt[rng.randint(len(prompt))] ^= 1
    by_ids = cache.match_length(prompt)
    by_hashes = cache.match_length_hashes(block_hashes(probe_tokens(prompt), BLOCK, fp))
    assert by_hashes == by_ids, (cut, len(prompt))
    assert by_ids <= max(len(prompt) - 1, 0) and by_ids % BLOCK == 0
    hits += by_ids > 0
  assert hits > 20  # the prompts did share cached prefixes
  # One implementation: the cache's keys are the module function's hashes.
  assert cache.block_hashes(roots[0]) == block_hashes(roots[0], BLOCK, fp)
  with pytest.raises(ValueError):
    block_hashes(roots[0], 0, fp)
