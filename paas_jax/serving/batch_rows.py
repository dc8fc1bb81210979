"""Row helpers of batched states and logits (the prefill engine's batches).

Sampling is keyed by ``(seed, absolute position)`` with the same
``sample_tokens`` as ``api.generate``, so a request produces the tokens of
single-process generation whatever batch row it occupies.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models import api
from paas_jax.serving.validation import RequestParams
from paas_jax.state import AttentionCache, DecodeState, MLACache


@jax.jit
def _sample_rows(logits, seeds, positions, temperature, top_k, top_p):
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
  return api.sample_tokens(logits, keys, temperature, top_k, top_p)


def sample_rows(logits, params: Sequence[RequestParams], positions: Sequence[int]) -> np.ndarray:
  """Samples one token per row, each with its own settings (as ``api.sample``)."""
  n = logits.shape[0]
  pad = n - len(params)
  params = list(params) + [RequestParams()] * pad
  positions = list(positions) + [0] * pad
  tok = _sample_rows(
      logits, jnp.asarray([p.seed for p in params], jnp.uint32),
      jnp.asarray(positions, jnp.int32),
      jnp.asarray([p.sampling.temperature for p in params], jnp.float32),
      jnp.asarray([p.sampling.top_k for p in params], jnp.int32),
      jnp.asarray([p.sampling.top_p for p in params], jnp.float32))
  return np.asarray(tok)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  if x.shape[0] >= rows:
    return x
  return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)])


def with_row(state: DecodeState, prefix: DecodeState, length: int) -> DecodeState:
  """``state`` (batched, device) with row 0 replaced by the batch-1 ``prefix``
  holding ``length`` tokens (growing caches copied into the first positions)."""
  def put(dst, src):
    src = jnp.asarray(src)
    if dst.ndim >= 2 and src.shape[1:] != dst.shape[1:]:  # a growing cache: first positions
      src = src[:, :length]
      return dst.at[0:1, :src.shape[1]].set(src.astype(dst.dtype))
    return dst.at[0:1].set(src.astype(dst.dtype))
  layers = tuple(jax.tree_util.tree_map(put, d, p) for d, p in zip(state.layers, prefix.layers))
  return DecodeState(layers=layers, lengths=state.lengths.at[0].set(length))


def select_row(state: DecodeState, row: int, capacity: int) -> DecodeState:
  """Row ``row`` of a batched (host) state as a batch-1 state with ``capacity`` positions."""
  def take(cache):
    if isinstance(cache, (AttentionCache, MLACache)):
      return jax.tree_util.tree_map(lambda x: x[row:row + 1, :capacity], cache)
    return jax.tree_util.tree_map(lambda x: x[row:row + 1], cache)
  return DecodeState(layers=tuple(take(c) for c in state.layers),
                     lengths=state.lengths[row:row + 1])

