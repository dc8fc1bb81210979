"""Layer kind ``A``: full softmax attention (GQA, RoPE, optional output gate, QK-norm)."""

from __future__ import annotations

import jax
from flax import struct

from paas_jax.models.attention import Attention, AttentionCache
from paas_jax.models.config import LayerKind, ModelConfig
from paas_jax.models.kinds.base import KindSpec, PagedLayout, PrefixRule, Shapes, StatePositions


@struct.dataclass
class PagedKV:
  """Full-attention KV of all slots in shared pages ``[num_pages, page_size, kv_heads, dim]``."""

  k_pages: jax.Array
  v_pages: jax.Array


def cache_shapes(config: ModelConfig, batch: int, capacity: int) -> Shapes:
  a = config.attention
  shape = (batch, capacity, a.n_kv_heads, config.attention_head_dim)
  return {"k": (shape, config.compute_dtype), "v": (shape, config.compute_dtype)}


def pool_shapes(config: ModelConfig, num_pages: int, page_size: int) -> Shapes:
  a = config.attention
  shape = (num_pages, page_size, a.n_kv_heads, config.attention_head_dim)
  return {"k_pages": (shape, config.compute_dtype), "v_pages": (shape, config.compute_dtype)}


def kv_bytes_per_position(config: ModelConfig) -> int:
  a = config.attention
  return 2 * a.n_kv_heads * config.attention_head_dim * config.compute_dtype.itemsize


def state_bytes(config: ModelConfig) -> tuple[int, int]:
  return 0, kv_bytes_per_position(config)


SPEC = KindSpec(kind=LayerKind.ATTENTION, make_mixer=Attention, cache_type=AttentionCache,
                cache_shapes=cache_shapes, state_bytes=state_bytes,
                prefix_rule=PrefixRule.BLOCK_KV, positions=StatePositions.LINEAR,
                paged=PagedLayout(PagedKV, pool_shapes))
