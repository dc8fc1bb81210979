"""MiniMax-M2.5 (229B), shape only: dense GQA (62 layers, hidden 3072, 48 query /
8 KV heads of 128). The dense baseline of the paper's Table 3."""

from paas_jax.models import AttentionConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="minimax_m2_5", vocab_size=200_064, d_model=3072, n_layers=62,
      layer_pattern="A", d_ff=1536,
      attention=AttentionConfig(n_heads=48, n_kv_heads=8, head_dim=128, qk_norm=True,
                                rope_fraction=0.5, rope_theta=5_000_000.0),
      moe=MoEConfig(n_experts=256, top_k=8, d_expert=1536, router="sigmoid"),
      tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=196_608)
