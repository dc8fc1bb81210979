"""Tiny dense GQA baseline of about the same size as the tiny hybrids."""

from paas_jax.models import AttentionConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_dense_gqa", vocab_size=256, d_model=64, n_layers=4, layer_pattern="A",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16),
      max_seq_len=1024)
