"""Tiny sliding-window : GQA hybrid, 5:1 (the MiMo-V2-Flash shape family)."""

from paas_jax.models import AttentionConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_swa_gqa", vocab_size=256, d_model=64, n_layers=6, layer_pattern="SSSSSA",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, window=8),
      max_seq_len=1024)
