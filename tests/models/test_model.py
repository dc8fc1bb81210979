"""Prefill/decode equivalences for every layer kind (issue 2, items i-iii)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax.models import api
from paas_jax.state import DecodeState
from tests.models.conftest import get_model, sweep

ATOL = 1e-4  # fp32


def _tokens(model: api.Model, n: int, seed: int = 0) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, model.config.vocab_size, size=n)


def test_prefill_then_decode_matches_full_prefill(model):
  toks = _tokens(model, 40)
  full, _ = api.prefill(model, toks)
  k = 13
  logits, state = api.prefill(model, toks[:k])
  rows = [logits[0]]
  for i in range(k, len(toks)):
    step_logits, state = api.decode_step(model, state, toks[i:i + 1])
    rows.append(step_logits)
  stitched = jnp.concatenate(rows, axis=0)
  np.testing.assert_allclose(stitched, full[0], atol=ATOL, rtol=0)
  assert int(state.lengths[0]) == len(toks)


@pytest.mark.parametrize("name, chunk", sweep([1, 7, 64, 70], 7))
def test_chunked_prefill_matches_one_shot(name, chunk):
  model = get_model(name)
  toks = _tokens(model, 70, seed=1)
  full, full_state = api.prefill(model, toks)
  state, pieces = None, []
  for s in range(0, len(toks), chunk):
    logits, state = api.prefill(model, toks[s:s + chunk], state)
    pieces.append(logits[0])
  np.testing.assert_allclose(jnp.concatenate(pieces, 0), full[0], atol=ATOL, rtol=0)
  # The states agree too (attention caches up to the live length).
  a, b = full_state.trim(), state.trim()
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               atol=ATOL, rtol=0)


def _stack(states: list[DecodeState]) -> DecodeState:
  capacity = max(s.capacity or 0 for s in states)
  grown = [s.grow(capacity) for s in states]
  return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, 0), *grown)


def test_batched_ragged_decode_matches_per_request(model):
  lengths = [3, 17, 9]
  prompts = [_tokens(model, n, seed=10 + n) for n in lengths]
  singles = [api.prefill(model, p)[1] for p in prompts]
  batch_state = _stack(singles)
  steps = 6
  feed = np.random.RandomState(5).randint(0, model.config.vocab_size, size=(steps, 3))
  batched = []
  for s in range(steps):
    logits, batch_state = api.decode_step(model, batch_state, feed[s])
    batched.append(logits)
  for r, state in enumerate(singles):
    for s in range(steps):
      logits, state = api.decode_step(model, state, feed[s, r:r + 1])
      np.testing.assert_allclose(batched[s][r], logits[0], atol=ATOL, rtol=0)
  np.testing.assert_array_equal(batch_state.lengths, np.array(lengths) + steps)


def test_ragged_batched_prefill_matches_per_row(model):
  lengths = [5, 12]
  rows = [_tokens(model, n, seed=n) for n in lengths]
  padded = np.zeros((2, max(lengths)), np.int32)
  for i, r in enumerate(rows):
    padded[i, :len(r)] = r
  logits, state = api.prefill(model, padded, lengths=lengths)
  for i, r in enumerate(rows):
    single, single_state = api.prefill(model, r)
    np.testing.assert_allclose(logits[i, :len(r)], single[0], atol=ATOL, rtol=0)
    # Decoding on from the batched state matches decoding on from the single one.
    nxt = np.array([7])
    a, _ = api.decode_step(model, state.select(i), nxt)
    b, _ = api.decode_step(model, single_state, nxt)
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_layerwise_prefill_matches_prefill(model):
  toks = _tokens(model, 21, seed=3)
  ref_logits, ref_state = api.prefill(model, toks)
  run = api.LayerwisePrefill(model, toks)
  seen = [i for i, _ in run]
  assert seen == list(range(model.config.n_layers))
  np.testing.assert_allclose(run.logits, ref_logits, atol=ATOL, rtol=0)
  for x, y in zip(jax.tree_util.tree_leaves(run.state), jax.tree_util.tree_leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=ATOL)
