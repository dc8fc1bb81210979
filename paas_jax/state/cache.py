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

from paas_jax.models.config import ModelConfig

# Capacity of attention caches grows in multiples of this many positions so
# that continuing prefill or decode recompiles once per block, not per token.
CAPACITY_ALIGN = 64


def round_up(n: int, multiple: int = CAPACITY_ALIGN) -> int:
  return max(multiple, -(-n // multiple) * multiple)


@struct.dataclass
class AttentionCache:
  """Full-attention KV. ``k``: [batch, capacity, kv_heads, head_dim]; ``v`` likewise.

  Position ``p`` of a request lives at index ``p``.
  """

  k: jax.Array
  v: jax.Array


@struct.dataclass
class MLACache:
  """MLA cache: ``latent`` [batch, capacity, kv_lora_rank] (normalised KV latent)
  and ``k_rope`` [batch, capacity, qk_rope_head_dim] (rotated, shared by heads)."""

  latent: jax.Array
  k_rope: jax.Array


@struct.dataclass
class SlidingWindowCache:
  """Ring buffer of the last ``window`` positions: ``k``, ``v``
  [batch, window, kv_heads, head_dim]; position ``p`` lives at ``p % window``."""

  k: jax.Array
  v: jax.Array


@struct.dataclass
class GatedDeltaCache:
  """``conv`` [batch, conv_kernel - 1, conv_channels] (last inputs of the short
  convolution) and ``recurrent`` [batch, v_heads, head_k_dim, head_v_dim] f32."""

  conv: jax.Array
  recurrent: jax.Array


@struct.dataclass
class Mamba2Cache:
  """``conv`` [batch, conv_kernel - 1, conv_channels] and ``ssm``
  [batch, heads, head_dim, d_state] f32."""

  conv: jax.Array
  ssm: jax.Array


LayerCache = Union[AttentionCache, MLACache, SlidingWindowCache, GatedDeltaCache,
                   Mamba2Cache]
GROWING_CACHES = (AttentionCache, MLACache)


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
      if isinstance(cache, AttentionCache):
        return int(cache.k.shape[1])
      if isinstance(cache, MLACache):
        return int(cache.latent.shape[1])
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


def _layer_shapes(config: ModelConfig, kind: str, batch: int, capacity: int
                  ) -> tuple[type, dict[str, tuple[tuple[int, ...], jnp.dtype]]]:
  """Shapes and dtypes of one layer's cache arrays."""
  act = config.compute_dtype
  f32 = jnp.dtype(jnp.float32)
  if kind in ("A", "S"):
    a = config.attention
    length = capacity if kind == "A" else a.window
    shape = (batch, length, a.n_kv_heads, config.attention_head_dim)
    cls = AttentionCache if kind == "A" else SlidingWindowCache
    return cls, {"k": (shape, act), "v": (shape, act)}
  if kind == "M":
    m = config.mla
    return MLACache, {"latent": ((batch, capacity, m.kv_lora_rank), act),
                      "k_rope": ((batch, capacity, m.qk_rope_head_dim), act)}
  if kind == "G":
    g = config.gated_delta
    channels = 2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim
    return GatedDeltaCache, {
        "conv": ((batch, g.conv_kernel - 1, channels), act),
        "recurrent": ((batch, g.n_v_heads, g.head_k_dim, g.head_v_dim), f32)}
  if kind == "m":
    s = config.mamba2
    channels = s.n_heads * s.head_dim + 2 * s.n_groups * s.d_state
    return Mamba2Cache, {
        "conv": ((batch, s.conv_kernel - 1, channels), act),
        "ssm": ((batch, s.n_heads, s.head_dim, s.d_state), f32)}
  raise ValueError(f"unknown layer kind {kind!r}")


def init_state(config: ModelConfig, batch: int = 1, capacity: int = 0) -> DecodeState:
  """An empty state for ``batch`` requests with room for ``capacity`` tokens."""
  layers = []
  for kind in config.layer_kinds:
    cls, shapes = _layer_shapes(config, kind, batch, capacity)
    layers.append(cls(**{name: jnp.zeros(shape, dtype)
                         for name, (shape, dtype) in shapes.items()}))
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
  latent) of one position summed over layers. Written independently of
  ``init_state`` so that tests can hold the two against each other.
  """
  act = config.compute_dtype.itemsize
  f32 = 4
  fixed, per_token = 4, 0  # lengths: int32[1]
  for kind in config.layer_kinds:
    if kind in ("A", "S"):
      a = config.attention
      kv_per_position = 2 * a.n_kv_heads * config.attention_head_dim * act
      if kind == "A":
        per_token += kv_per_position
      else:
        fixed += a.window * kv_per_position
    elif kind == "M":
      per_token += (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * act
    elif kind == "G":
      g = config.gated_delta
      conv_channels = 2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim
      fixed += (g.conv_kernel - 1) * conv_channels * act
      fixed += g.n_v_heads * g.head_k_dim * g.head_v_dim * f32
    elif kind == "m":
      s = config.mamba2
      conv_channels = s.n_heads * s.head_dim + 2 * s.n_groups * s.d_state
      fixed += (s.conv_kernel - 1) * conv_channels * act
      fixed += s.n_heads * s.head_dim * s.d_state * f32
  return StateBytes(fixed=fixed, per_token=per_token, seq_len=seq_len)
