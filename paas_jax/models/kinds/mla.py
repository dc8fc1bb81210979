"""Layer kind ``M``: multi-head latent attention (cache: the normalised KV latent plus
the shared rotated key; decode in absorbed form over a paged latent pool)."""

from __future__ import annotations

import jax
from flax import struct

from paas_jax.models.attention import MLACache, MLAttention
from paas_jax.models.config import LayerKind, ModelConfig
from paas_jax.models.kinds.base import KindSpec, PagedLayout, PrefixRule, Shapes, StatePositions


@struct.dataclass
class PagedLatent:
  """MLA cache in shared pages: ``latent_pages [P, ps, r]``, ``rope_pages [P, ps, dr]``."""

  latent_pages: jax.Array
  rope_pages: jax.Array


def cache_shapes(config: ModelConfig, batch: int, capacity: int) -> Shapes:
  m, act = config.mla, config.compute_dtype
  return {"latent": ((batch, capacity, m.kv_lora_rank), act),
          "k_rope": ((batch, capacity, m.qk_rope_head_dim), act)}


def pool_shapes(config: ModelConfig, num_pages: int, page_size: int) -> Shapes:
  m, act = config.mla, config.compute_dtype
  return {"latent_pages": ((num_pages, page_size, m.kv_lora_rank), act),
          "rope_pages": ((num_pages, page_size, m.qk_rope_head_dim), act)}


def state_bytes(config: ModelConfig) -> tuple[int, int]:
  m = config.mla
  return 0, (m.kv_lora_rank + m.qk_rope_head_dim) * config.compute_dtype.itemsize


SPEC = KindSpec(kind=LayerKind.MLA, make_mixer=MLAttention, cache_type=MLACache,
                cache_shapes=cache_shapes, state_bytes=state_bytes,
                prefix_rule=PrefixRule.BLOCK_KV, positions=StatePositions.LINEAR,
                paged=PagedLayout(PagedLatent, pool_shapes))
