"""Layer kind ``G``: Gated DeltaNet / KDA linear attention (cache: the short
convolution's tail and the f32 recurrent state; fixed size)."""

from __future__ import annotations

import numpy as np

from paas_jax.models.config import LayerKind, ModelConfig
from paas_jax.models.kinds.base import KindSpec, PrefixRule, Shapes, StatePositions
from paas_jax.models.recurrent import GatedDeltaCache, GatedDeltaNet


def _conv_channels(config: ModelConfig) -> int:
  g = config.gated_delta
  return 2 * g.n_k_heads * g.head_k_dim + g.n_v_heads * g.head_v_dim


def cache_shapes(config: ModelConfig, batch: int, capacity: int) -> Shapes:
  del capacity  # fixed size
  g = config.gated_delta
  return {"conv": ((batch, g.conv_kernel - 1, _conv_channels(config)), config.compute_dtype),
          "recurrent": ((batch, g.n_v_heads, g.head_k_dim, g.head_v_dim),
                        np.dtype(np.float32))}


def state_bytes(config: ModelConfig) -> tuple[int, int]:
  g = config.gated_delta
  conv = (g.conv_kernel - 1) * _conv_channels(config) * config.compute_dtype.itemsize
  return conv + g.n_v_heads * g.head_k_dim * g.head_v_dim * 4, 0


SPEC = KindSpec(kind=LayerKind.GATED_DELTA, make_mixer=GatedDeltaNet,
                cache_type=GatedDeltaCache, cache_shapes=cache_shapes, state_bytes=state_bytes,
                prefix_rule=PrefixRule.EXACT_CHECKPOINT, positions=StatePositions.SUMMARY,
                summary_fields=("recurrent",))
