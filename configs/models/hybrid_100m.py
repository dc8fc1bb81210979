"""A ~100M-parameter Gated DeltaNet : GQA (3:1) hybrid for benchmarks."""

from paas_jax.models import AttentionConfig, GatedDeltaConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="hybrid_100m", vocab_size=32_000, d_model=768, n_layers=12, layer_pattern="GGGA",
      d_ff=2048,
      attention=AttentionConfig(n_heads=12, n_kv_heads=4, head_dim=64, output_gate=True,
                                qk_norm=True),
      gated_delta=GatedDeltaConfig(n_k_heads=6, n_v_heads=12, head_k_dim=64, head_v_dim=64),
      tie_embeddings=True, max_seq_len=32_768)
