"""Tiny Mamba2 : GQA hybrid, 3:1 (the Nemotron-H / Jamba shape family)."""

from paas_jax.models import AttentionConfig, Mamba2Config, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_mamba2_gqa", vocab_size=256, d_model=64, n_layers=4, layer_pattern="mmmA",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=16),
      mamba2=Mamba2Config(n_heads=4, head_dim=16, d_state=16, n_groups=2),
      # Untied head: tied to unit-scale embeddings, the random-init model echoes
      # the last prompt token and decodes the same text from a wrong or zeroed
      # state (issue #12, experiments/state_sensitivity.py).
      tie_embeddings=False, max_seq_len=1024)
