"""Layer kind ``m``: Mamba2 (SSD) (cache: the short convolution's tail and the f32
SSM state; fixed size)."""

from __future__ import annotations

import numpy as np

from paas_jax.models.config import LayerKind, ModelConfig
from paas_jax.models.kinds.base import KindSpec, PrefixRule, Shapes, StatePositions
from paas_jax.models.recurrent import Mamba2, Mamba2Cache


def _conv_channels(config: ModelConfig) -> int:
  s = config.mamba2
  return s.n_heads * s.head_dim + 2 * s.n_groups * s.d_state


def cache_shapes(config: ModelConfig, batch: int, capacity: int) -> Shapes:
  del capacity  # fixed size
  s = config.mamba2
  return {"conv": ((batch, s.conv_kernel - 1, _conv_channels(config)), config.compute_dtype),
          "ssm": ((batch, s.n_heads, s.head_dim, s.d_state), np.dtype(np.float32))}


def state_bytes(config: ModelConfig) -> tuple[int, int]:
  s = config.mamba2
  conv = (s.conv_kernel - 1) * _conv_channels(config) * config.compute_dtype.itemsize
  return conv + s.n_heads * s.head_dim * s.d_state * 4, 0


SPEC = KindSpec(kind=LayerKind.MAMBA2, make_mixer=Mamba2, cache_type=Mamba2Cache,
                cache_shapes=cache_shapes, state_bytes=state_bytes,
                prefix_rule=PrefixRule.EXACT_CHECKPOINT, positions=StatePositions.SUMMARY,
                summary_fields=("ssm",))
