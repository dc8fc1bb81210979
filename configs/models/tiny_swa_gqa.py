"""Tiny sliding-window : GQA hybrid, 5:1 (the MiMo-V2-Flash shape family)."""

from paas_jax.models import AttentionConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_swa_gqa", vocab_size=256, d_model=64, n_layers=6, layer_pattern="SSSSSA",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, window=8),
      # Untied head: tied to unit-scale embeddings, the random-init model echoes
      # the last prompt token and decodes the same text from a wrong or zeroed
      # state (issue #12, experiments/state_sensitivity.py).
      tie_embeddings=False, max_seq_len=1024)
