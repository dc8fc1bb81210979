"""Qwen3-235B-A22B, shape only: dense GQA (94 layers, hidden 4096, 64 query / 4 KV
heads of 128, 128 experts top-8, vocab 151936)."""

from paas_jax.models import AttentionConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="qwen3_235b", vocab_size=151_936, d_model=4096, n_layers=94,
      layer_pattern="A", d_ff=12_288,
      attention=AttentionConfig(n_heads=64, n_kv_heads=4, head_dim=128, qk_norm=True,
                                rope_theta=1_000_000.0),
      moe=MoEConfig(n_experts=128, top_k=8, d_expert=1536),
      tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=131_072)
