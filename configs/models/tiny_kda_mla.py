"""Tiny KDA : MLA hybrid, 3:1, with a top-2 MoE (the Kimi Linear shape family)."""

from paas_jax.models import GatedDeltaConfig, MLAConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_kda_mla", vocab_size=256, d_model=64, n_layers=4, layer_pattern="GGGM",
      d_ff=128,
      mla=MLAConfig(n_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16),
      gated_delta=GatedDeltaConfig(n_k_heads=4, n_v_heads=4, head_k_dim=16, head_v_dim=16,
                                   gate="kda"),
      moe=MoEConfig(n_experts=4, top_k=2, d_expert=32, n_shared_experts=1,
                    router="sigmoid"),
      # Untied head: tied to unit-scale embeddings, the random-init model echoes
      # the last prompt token and decodes the same text from a wrong or zeroed
      # state (issue #12, experiments/state_sensitivity.py).
      tie_embeddings=False, max_seq_len=1024)
