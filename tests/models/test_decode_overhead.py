"""Decode hot loop: no device-to-host sync per step, donated state, same logits.

The pre-#17 path (``decode_step_host_synced``), which reads ``max(lengths)``
back every step, is the negative control.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models import api
from tests.models.conftest import get_model

MODEL = "tiny_gdn_gqa"


def _prefilled(batch=2, prompt=10, lengths=None):
  model = get_model(MODEL)
  tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (batch, prompt))
  logits, state = api.prefill(model, tokens.astype(np.int32), lengths=lengths)
  return model, state


class _HostReads:
  """Counts ``jnp.max`` calls on concrete device arrays (the old capacity
  check's read-back ``int(jnp.max(state.lengths))``). On CPU the transfer
  guard does not fire for such reads (host and device memory are shared),
  so the test watches the call itself."""

  def __init__(self, monkeypatch):
    self.count = 0
    original = jnp.max

    def spy(x, *args, **kwargs):
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        self.count += 1
      return original(x, *args, **kwargs)
    monkeypatch.setattr(jnp, "max", spy)


def test_decode_steps_do_not_read_back_lengths(monkeypatch):
  model, state = _prefilled()
  feed = jax.device_put(np.asarray([3, 4], np.int32))
  _, state = api.decode_step(model, state, feed)  # compile outside the count
  reads = _HostReads(monkeypatch)
  for _ in range(3):
    _, state = api.decode_step(model, state, feed)
  assert reads.count == 0


def test_negative_control_old_path_reads_back(monkeypatch):
  model, state = _prefilled()
  feed = jax.device_put(np.asarray([3, 4], np.int32))
  _, state = api.decode_step_host_synced(model, state, feed)
  reads = _HostReads(monkeypatch)
  for _ in range(3):
    _, state = api.decode_step_host_synced(model, state, feed)
  assert reads.count == 3


def test_donated_state_is_consumed_and_logits_match():
  model, state = _prefilled(lengths=[10, 6])
  feed = np.asarray([3, 4], np.int32)
  want, want_state = api.decode_step_host_synced(model, state, feed)
  kept_logits, kept = api.decode_step(model, state, feed)
  assert not state.lengths.is_deleted()  # default: the caller keeps its state
  got, got_state = api.decode_step(model, kept, feed, donate=True)
  assert kept.lengths.is_deleted()       # donated: buffers now belong to got_state
  np.testing.assert_array_equal(np.asarray(kept_logits), np.asarray(want))
  again, _ = api.decode_step_host_synced(model, want_state, feed)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_capacity_grows_across_the_boundary_without_sync():
  # Ragged rows, then enough steps to cross the state's capacity: the host
  # bound must grow the cache in time (an overflow would clamp writes and
  # change the logits versus the synced path).
  model, state = _prefilled(lengths=[10, 3])
  capacity = state.capacity
  fast, slow = state, state
  feed = np.asarray([5, 6], np.int32)
  for _ in range(capacity - 10 + 2):
    fast_logits, fast = api.decode_step(model, fast, feed)
    slow_logits, slow = api.decode_step_host_synced(model, slow, feed)
  assert fast.capacity > capacity
  np.testing.assert_allclose(np.asarray(fast_logits), np.asarray(slow_logits), rtol=0, atol=0)
