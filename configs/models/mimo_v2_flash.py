"""MiMo-V2-Flash (309B), shape only: sliding-window : GQA 5:1, window 128.

Approximate public shapes (48 layers, hidden 4096, 64 query heads, 8 KV heads of
128, 128-token window on the local layers). Used for state-size accounting.
"""

from paas_jax.models import AttentionConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="mimo_v2_flash", vocab_size=152_576, d_model=4096, n_layers=48,
      layer_pattern="SSSSSA", d_ff=2048,
      attention=AttentionConfig(n_heads=64, n_kv_heads=8, head_dim=128, window=128),
      moe=MoEConfig(n_experts=256, top_k=8, d_expert=2048),
      tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=262_144)
