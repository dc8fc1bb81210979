"""``tiny_gdn_gqa`` with eight heads of every kind (attention KV and gated-delta
key/value heads), so that tensor parallelism over 8 devices splits every layer's
state by head (tensor-parallel serving tests at TP=8)."""

from paas_jax.models import AttentionConfig, GatedDeltaConfig, ModelConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="tiny_gdn_gqa_8h", vocab_size=256, d_model=64, n_layers=4, layer_pattern="GGGA",
      d_ff=128,
      attention=AttentionConfig(n_heads=8, n_kv_heads=8, head_dim=8, output_gate=True,
                                qk_norm=True, rope_fraction=0.5),
      gated_delta=GatedDeltaConfig(n_k_heads=8, n_v_heads=8, head_k_dim=8, head_v_dim=8,
                                   gate="gdn"),
      tie_embeddings=False, max_seq_len=1024)
