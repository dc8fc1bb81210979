"""A ~100M-parameter dense GQA baseline matching hybrid_100m's width and depth."""

from paas_jax.models import AttentionConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="dense_100m", vocab_size=32_000, d_model=768, n_layers=12, layer_pattern="A",
      d_ff=2048,
      attention=AttentionConfig(n_heads=12, n_kv_heads=4, head_dim=64, qk_norm=True),
      tie_embeddings=True, max_seq_len=32_768)
