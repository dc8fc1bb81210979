"""Ring-2.5-1T, shape only: Lightning linear attention : MLA 7:1.

Lightning attention keeps a [heads, d_k, d_v] state per layer like the gated delta
rule, so its state is accounted with a ``G`` layer of the same shape (the math
differs; only sizes are used). Approximate public shapes: 80 layers, hidden 8192,
64 linear heads of 128, MLA kv_lora_rank 512 + 64 RoPE.
"""

from paas_jax.models import GatedDeltaConfig, MLAConfig, ModelConfig, MoEConfig


def get_config() -> ModelConfig:
  return ModelConfig(
      name="ring_2_5_1t", vocab_size=157_184, d_model=8192, n_layers=80,
      layer_pattern="GGGGGGGM", d_ff=2048,
      mla=MLAConfig(n_heads=64, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128),
      gated_delta=GatedDeltaConfig(n_k_heads=64, n_v_heads=64, head_k_dim=128,
                                   head_v_dim=128, gate="gdn"),
      moe=MoEConfig(n_experts=256, top_k=8, d_expert=2048, n_shared_experts=1,
                    router="sigmoid"),
      tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16", max_seq_len=131_072)
