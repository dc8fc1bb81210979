"""Qwen3.5-397B-A17B, shape only: Gated DeltaNet : gated GQA 3:1.

Shapes follow the Qwen3-Next/Qwen3.5 family's public configs (60 layers, hidden 4096,
full attention 32 query / 2 KV heads of 256 with partial RoPE and an output gate,
linear attention 16 key / 64 value heads of 128, 512 experts top-10, vocab 248320).
Used for state-size accounting; check against the released config.json before
quoting absolute numbers.
"""

from paas_jax.models import AttentionConfig, GatedDeltaConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="qwen3_5_397b", vocab_size=248_320, d_model=4096, n_layers=60,
      layer_pattern="GGGA", d_ff=1024,
      attention=AttentionConfig(n_heads=32, n_kv_heads=2, head_dim=256, rope_fraction=0.25,
                                output_gate=True, qk_norm=True, rope_theta=10_000_000.0),
      gated_delta=GatedDeltaConfig(n_k_heads=16, n_v_heads=64, head_k_dim=128,
                                   head_v_dim=128, gate="gdn"),
      moe=MoEConfig(n_experts=512, top_k=10, d_expert=1024, n_shared_experts=1),
      tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=262_144)
