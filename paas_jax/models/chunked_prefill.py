"""Prefill whose activation memory is bounded by the chunk, not by the prompt.

``api.prefill`` runs a whole prompt as one chunk and returns logits for every
position: f32 [batch, seq, vocab] (2 GB at 16K tokens of a 32K vocabulary) plus
every layer's [seq, ...] activations, and the caller's state is copied, not
updated in place. ``prefill_chunked`` runs fixed ``chunk``-token pieces through
one compiled step that

* allocates the state once, at the prompt's capacity (no grow-and-copy),
* updates it in place (the state buffers are donated to each step),
* applies the output head only at each row's last token ([batch, vocab]).

Attention in a chunk reads the cache block by block (``flash_attention``'s
online softmax), so what grows with the prompt is the state itself. Same
tokens and state as ``api.prefill`` over the same prompt (float summation
order aside; ``tests/models/test_chunked_prefill.py``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paas_jax.models.api import Model, graphdef_of
from paas_jax.state import DecodeState, init_state, round_up

DEFAULT_CHUNK = 512


def _chunk(graph, params, tokens, state, n_valid, last_logits):
  logits, state = nnx.merge(graphdef_of(graph), params).prefill_last(tokens, state, n_valid)
  # A row whose prompt ended in an earlier chunk keeps its logits.
  return jnp.where((n_valid > 0)[:, None], logits, last_logits), state


# The first chunk of a caller's state must not consume it; later chunks update the
# state this function owns in place.
_chunk_core = jax.jit(_chunk, static_argnums=0)
_chunk_core_donating = jax.jit(_chunk, static_argnums=0, donate_argnums=(3, 5))


def prefill_chunked(model: Model, tokens, state: DecodeState | None = None, *,
                    chunk: int = DEFAULT_CHUNK, lengths: Sequence[int] | None = None
                    ) -> tuple[jax.Array, DecodeState]:
  """Prefills ``tokens`` in ``chunk``-token pieces; logits of the last token only.

  Args:
    model: the model.
    tokens: int [seq] or [batch, seq]; rows may be right-padded, see ``lengths``.
    state: state to continue from (not modified); None starts fresh.
    chunk: tokens per compiled step (one shape for the whole prompt).
    lengths: int [batch], real tokens per row (default: all).

  Returns:
    (logits f32 [batch, vocab] at each row's last real token, the advanced state).

  Raises:
    ValueError: bad token ids or shapes, or a context beyond ``max_seq_len``.
  """
  config = model.config
  arr = np.asarray(tokens)
  if arr.ndim == 1:
    arr = arr[None, :]
  if arr.ndim != 2 or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"tokens must be non-empty integer [seq] or [batch, seq], got "
                     f"{arr.dtype} {arr.shape}")
  if arr.min() < 0 or arr.max() >= config.vocab_size:
    raise ValueError(f"token ids must lie in [0, {config.vocab_size})")
  if chunk < 1:
    raise ValueError(f"chunk must be positive, got {chunk}")
  batch, seq = arr.shape
  n_real = np.full(batch, seq, np.int32) if lengths is None else np.asarray(lengths, np.int32)
  if n_real.shape != (batch,) or n_real.min() < 0 or n_real.max() > seq:
    raise ValueError(f"lengths must be [{batch}] values in [0, {seq}], got {n_real}")
  start = 0 if state is None else int(np.max(np.asarray(state.lengths)))
  needed = start + seq
  if needed > config.max_seq_len:
    raise ValueError(f"context of {needed} tokens exceeds max_seq_len={config.max_seq_len} "
                     f"of model {config.name!r}")
  capacity = min(round_up(needed), max(config.max_seq_len, needed))
  donate_first = state is None
  if state is None:
    state = init_state(config, batch, capacity)
  elif state.batch_size != batch:
    raise ValueError(f"state has batch {state.batch_size}, tokens have batch {batch}")
  else:
    state = state.grow(capacity)
  padded = np.zeros((batch, -(-seq // chunk) * chunk), np.int32)
  padded[:, :seq] = arr
  last = jnp.zeros((batch, config.vocab_size), jnp.float32)
  for i, s in enumerate(range(0, seq, chunk)):
    n_valid = np.clip(n_real - s, 0, chunk).astype(np.int32)
    core = _chunk_core_donating if (i > 0 or donate_first) else _chunk_core
    last, state = core(model.static_graph, model.params, jnp.asarray(padded[:, s:s + chunk]),
                       state, jnp.asarray(n_valid), last)
  return last, state
