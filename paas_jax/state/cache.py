"""Typed per-layer decode caches and the per-request decode state.

The decode state is what PrfaaS ships between regions: one typed cache per
layer plus the number of tokens each request has consumed. Full-attention
caches grow with the context; sliding-window ring buffers and recurrent states
have a fixed size. Recurrent states are kept in f32 whatever the activation
dtype, because they integrate over the whole context.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paas_jax.models.attention import AttentionCache, MLACache, SlidingWindowCache
from paas_jax.models.config import ModelConfig
from paas_jax.models.kinds import GROWING_CACHES, kind_spec
from paas_jax.models.recurrent import GatedDeltaCache, Mamba2Cache

# Capacity of attention caches grows in multiples of this many positions so
# that continuing prefill or decode recompiles once per block, not per token.
CAPACITY_ALIGN = 64


def round_up(n: int, multiple: int = CAPACITY_ALIGN) -> int:
  return max(multiple, -(-n // multiple) * multiple)


LayerCache = Union[AttentionCache, MLACache, SlidingWindowCache, GatedDeltaCache,
                   Mamba2Cache]


@struct.dataclass
class DecodeState:
  """Decode state of a batch of requests.

  Attributes:
    layers: one typed cache per layer, in layer order.
    lengths: int32 [batch], tokens consumed by each request.
  """

  layers: tuple[LayerCache, ...]
  lengths: jax.Array

  @property
  def batch_size(self) -> int:
    return int(self.lengths.shape[0])

  @property
  def capacity(self) -> int | None:
    """Token capacity of the growing (attention) caches; None if there are none."""
    for cache in self.layers:
      if isinstance(cache, GROWING_CACHES):
        return int(jax.tree_util.tree_leaves(cache)[0].shape[1])  # [batch, capacity, ...]
    return None

  @property
  def nbytes(self) -> int:
    """Exact bytes held by every array of the state."""
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree_util.tree_leaves(self)))

  def grow(self, capacity: int) -> "DecodeState":
    """Zero-pads the growing caches to ``capacity`` positions (never shrinks)."""
    current = self.capacity
    if current is None or capacity <= current:
      return self
    pad = capacity - current

    def pad_tokens(x):
      widths = [(0, 0)] * x.ndim
      widths[1] = (0, pad)
      return jnp.pad(x, widths)

    layers = tuple(
        jax.tree_util.tree_map(pad_tokens, c) if isinstance(c, GROWING_CACHES) else c
        for c in self.layers)
    return self.replace(layers=layers)

  def trim(self) -> "DecodeState":
    """Cuts the growing caches to the longest live request (exact-size state)."""
    if self.capacity is None:
      return self
    live = int(jnp.max(self.lengths)) if self.batch_size else 0
    layers = tuple(
        jax.tree_util.tree_map(lambda x: x[:, :live], c)
        if isinstance(c, GROWING_CACHES) else c for c in self.layers)
    return self.replace(layers=layers)

  def select(self, index: int) -> "DecodeState":
    """The state of request ``index`` as a batch-1 state."""
    return jax.tree_util.tree_map(lambda x: x[index:index + 1], self)


def init_state(config: ModelConfig, batch: int = 1, capacity: int = 0) -> DecodeState:
  """An empty state for ``batch`` requests with room for ``capacity`` tokens."""
  layers = []
  for kind in config.layer_kinds:
    spec = kind_spec(kind)
    layers.append(spec.cache_type(**{
        name: jnp.zeros(shape, dtype)
        for name, (shape, dtype) in spec.cache_shapes(config, batch, capacity).items()}))
  return DecodeState(layers=tuple(layers), lengths=jnp.zeros((batch,), jnp.int32))


def abstract_state(config: ModelConfig, batch: int = 1, capacity: int = 0) -> DecodeState:
  """Like ``init_state`` but with ``jax.ShapeDtypeStruct`` leaves (no memory)."""
  return jax.eval_shape(lambda: init_state(config, batch, capacity))


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Analytic state size of one request: ``total = fixed + per_token * seq_len``."""

  fixed: int
  per_token: int
  seq_len: int

  @property
  def total(self) -> int:
    return self.fixed + self.per_token * self.seq_len


def state_bytes(config: ModelConfig, seq_len: int) -> StateBytes:
  """Closed-form size of the exact-size (trimmed) state of one request.

  The fixed part holds recurrent states, conv tails, sliding-window ring buffers
  and the 4-byte length; the per-token part is the full-attention KV (or MLA
  latent) of one position summed over layers. Each kind's ``state_bytes`` is
  written independently of its ``cache_shapes`` (``init_state``) so that tests
  can hold the two against each other.
  """
  fixed, per_token = 4, 0  # lengths: int32[1]
  for kind in config.layer_kinds:
    kind_fixed, kind_per_token = kind_spec(kind).state_bytes(config)
    fixed += kind_fixed
    per_token += kind_per_token
  return StateBytes(fixed=fixed, per_token=per_token, seq_len=seq_len)
