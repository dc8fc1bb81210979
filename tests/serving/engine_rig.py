"""Driving the serving engines directly in tests (test_engine.py, test_tensor_parallel.py)."""

from __future__ import annotations

from typing import Sequence

from paas_jax.serving.decode_engine import DecodeEngine


def decode_to_completion(de: DecodeEngine, prefilled: Sequence[tuple]) -> dict[str, list[int]]:
  """Continuous batching of prefilled requests over ``de``'s slots until each has
  produced ``max_new_tokens``.

  Args:
    prefilled: (PrefillInput, its PrefillEngine output) pairs, inserted in order
      as slots free up.
  Returns:
    request id -> its tokens, the prefill's first token included.
  """
  pending, active, result = list(prefilled), {}, {}
  while pending or active:
    while pending and de.free_slots:
      r, o = pending.pop(0)
      slot = de.reserve(len(r.prompt) + r.params.max_new_tokens)
      de.insert(o.state, slot, o.first_token, r.params)
      active[slot] = (r, [o.first_token])
    tokens = de.generate()
    for slot in list(active):
      r, got = active[slot]
      got.append(int(tokens[slot]))
      if len(got) == r.params.max_new_tokens:
        result[r.request_id] = got
        del active[slot]
        de.free(slot)
  return result
