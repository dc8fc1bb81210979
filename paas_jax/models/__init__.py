"""Hybrid-attention language models (Flax NNX) and their inference API."""

from paas_jax.models.config import (
    AttentionConfig,
    GatedDeltaConfig,
    Mamba2Config,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from paas_jax.models.registry import list_configs, load_config
