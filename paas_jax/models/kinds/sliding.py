"""Layer kind ``S``: sliding-window attention over a ring buffer of the last ``window``
positions (fixed size, so the decode engine keeps it slot-indexed, not paged)."""

from __future__ import annotations

from flax import nnx

from paas_jax.models.attention import Attention, SlidingWindowCache
from paas_jax.models.config import LayerKind, ModelConfig
from paas_jax.models.kinds.attention import kv_bytes_per_position
from paas_jax.models.kinds.base import KindSpec, PrefixRule, Shapes, StatePositions


def make_mixer(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  return Attention(config, rngs, window=config.attention.window)


def cache_shapes(config: ModelConfig, batch: int, capacity: int) -> Shapes:
  del capacity  # the ring buffer holds the window whatever the context
  a = config.attention
  shape = (batch, a.window, a.n_kv_heads, config.attention_head_dim)
  return {"k": (shape, config.compute_dtype), "v": (shape, config.compute_dtype)}


def state_bytes(config: ModelConfig) -> tuple[int, int]:
  return config.attention.window * kv_bytes_per_position(config), 0


SPEC = KindSpec(kind=LayerKind.SLIDING, make_mixer=make_mixer, cache_type=SlidingWindowCache,
                cache_shapes=cache_shapes, state_bytes=state_bytes,
                prefix_rule=PrefixRule.EXACT_CHECKPOINT, positions=StatePositions.RING)
