"""Tiny dense GQA baseline of about the same size as the tiny hybrids."""

from paas_jax.models import AttentionConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_dense_gqa", vocab_size=256, d_model=64, n_layers=4, layer_pattern="A",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16),
      # Untied head: tied to unit-scale embeddings, the random-init model echoes
      # the last prompt token and decodes the same text from a wrong or zeroed
      # state (issue #12, experiments/state_sensitivity.py).
      tie_embeddings=False, max_seq_len=1024)
