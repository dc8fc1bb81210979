"""Chunked prefill (models/chunked_prefill.py) equals one-shot ``api.prefill``.

``test_mixed`` has every layer kind (G M S m A) and MoE in one stack, so each
kind's chunk continuation is covered; a 64-token prompt in 16-token chunks
crosses the sliding window (5) and the recurrent chunk size (16).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from paas_jax.models import api
from paas_jax.models.chunked_prefill import prefill_chunked
from tests.models.conftest import get_model

MODEL = "test_mixed"
TOL = dict(rtol=2e-5, atol=2e-5)


def _tokens(batch, seq, seed=0):
  model = get_model(MODEL)
  return np.random.RandomState(seed).randint(0, model.config.vocab_size,
                                             (batch, seq)).astype(np.int32)


def _assert_states_close(a, b):
  np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
  for x, y in zip(jax.tree_util.tree_leaves(a.trim()), jax.tree_util.tree_leaves(b.trim())):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), **TOL)


@functools.cache
def _one_shot():
  """(tokens [2, 64], lengths, one-shot logits, state): shared, so the tests below
  compile one prefill shape and one chunk shape."""
  model = get_model(MODEL)
  tokens = _tokens(2, 64)
  lengths = [64, 27]
  full, full_state = api.prefill(model, tokens, lengths=lengths)
  return tokens, lengths, full, full_state


def test_chunked_equals_one_shot_ragged_batch():
  model = get_model(MODEL)
  tokens, lengths, full, full_state = _one_shot()
  last, state = prefill_chunked(model, tokens, chunk=16, lengths=lengths)
  assert last.shape == (2, model.config.vocab_size)
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(last[row]), np.asarray(full[row, n - 1]), **TOL)
  _assert_states_close(state, full_state)
  # The state decodes on as the one-shot one does.
  feed = np.argmax(np.asarray(last), -1).astype(np.int32)
  a, _ = api.decode_step(model, state, feed)
  b, _ = api.decode_step(model, full_state, feed)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_chunked_continues_a_callers_state_without_consuming_it():
  model = get_model(MODEL)
  tokens, lengths, full, full_state = _one_shot()
  _, head = api.prefill(model, tokens[:, :16], lengths=[16, 16])
  last, state = prefill_chunked(model, tokens[:, 16:], head, chunk=16,
                                lengths=[n - 16 for n in lengths])
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(last[row]), np.asarray(full[row, n - 1]), **TOL)
  _assert_states_close(state, full_state)
  # The caller's state was not donated: it is still readable and still says 16.
  assert np.asarray(head.lengths).tolist() == [16, 16]
  assert np.isfinite(np.asarray(jax.tree_util.tree_leaves(head)[0])).all()


def test_negative_control_dropping_the_state_between_chunks_is_caught():
  """Prefilling only the last chunk (a broken continuation) gives other logits."""
  model = get_model(MODEL)
  tokens, _, full, _ = _one_shot()
  broken, _ = prefill_chunked(model, tokens[:, 48:], chunk=16)
  assert not np.allclose(np.asarray(broken[0]), np.asarray(full[0, -1]), **TOL)


def test_bad_inputs_are_refused():
  model = get_model(MODEL)
  with pytest.raises(ValueError, match="token ids"):
    prefill_chunked(model, [model.config.vocab_size])
  with pytest.raises(ValueError, match="max_seq_len"):
    prefill_chunked(model, np.zeros(model.config.max_seq_len + 1, np.int32))
  with pytest.raises(ValueError, match="chunk"):
    prefill_chunked(model, [1, 2], chunk=0)
  with pytest.raises(ValueError, match="lengths"):
    prefill_chunked(model, [[1, 2]], lengths=[3])
