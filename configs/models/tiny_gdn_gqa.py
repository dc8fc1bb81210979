"""Tiny Gated DeltaNet : gated GQA hybrid, 3:1 (Qwen3-Next / Qwen3.5 shape family)."""

from paas_jax.models import AttentionConfig, GatedDeltaConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_gdn_gqa", vocab_size=256, d_model=64, n_layers=4, layer_pattern="GGGA",
      d_ff=128,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, output_gate=True,
                                qk_norm=True, rope_fraction=0.5),
      gated_delta=GatedDeltaConfig(n_k_heads=2, n_v_heads=4, head_k_dim=16, head_v_dim=16,
                                   gate="gdn"),
      # Untied head: tied to unit-scale embeddings, the random-init model echoes
      # the last prompt token and decodes the same text from a wrong or zeroed
      # state (issue #12, experiments/state_sensitivity.py).
      tie_embeddings=False, max_seq_len=1024)
