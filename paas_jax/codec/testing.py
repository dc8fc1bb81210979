"""Random decode states for codec / transport tests and benchmarks."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models.config import ModelConfig
from paas_jax.state import DecodeState, SlidingWindowCache, abstract_state
from paas_jax.state.cache import GROWING_CACHES


def random_state(config: ModelConfig, lengths: Sequence[int], capacity: int,
                 seed: int = 0) -> DecodeState:
  """A state of ``config`` with random content and the given lengths.

  Every array is filled, including positions past ``lengths`` (as a reused
  cache slot would be), so tests see whether the codec trims them. Returns
  numpy leaves: cheap to build and accepted everywhere a jax array is.
  """
  like = abstract_state(config, len(lengths), capacity)
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten(like)
  filled = []
  for leaf in leaves:
    if leaf.dtype == jnp.int32:
      filled.append(np.asarray(lengths, np.int32))
    else:
      filled.append(rng.standard_normal(leaf.shape, np.float32).astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, filled)


def assert_states_match(original: DecodeState, restored: DecodeState, n: int) -> None:
  """Asserts a restored state equals the original on every live position.

  Growing caches (attention, MLA) must match on positions [0, n) and be zero
  beyond (the restore pads with zeros up to the template's capacity);
  sliding-window rings on their first min(n, window) slots; every other leaf
  (recurrent states, conv tails, lengths) exactly.
  """
  assert jax.tree_util.tree_structure(original) == jax.tree_util.tree_structure(restored)
  for cache_o, cache_r in zip(original.layers, restored.layers):
    for a, b in zip(jax.tree_util.tree_leaves(cache_o), jax.tree_util.tree_leaves(cache_r)):
      a, b = np.asarray(a), np.asarray(b)
      assert a.dtype == b.dtype, (a.dtype, b.dtype)
      if isinstance(cache_o, GROWING_CACHES + (SlidingWindowCache,)):
        live = min(n, a.shape[1])
        np.testing.assert_array_equal(a[:, :live], b[:, :live])
        assert not b[:, live:].any(), "positions past the live tokens must be zero"
      else:
        np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.asarray(original.lengths), np.asarray(restored.lengths))
