"""Kimi Linear 48B-A3B, shape only (no weights): KDA : MLA 3:1, 27 layers.

From the public config (hidden 2304, 27 layers, MLA on layers 4, 8, ..., 24 and 27
(1-based), KDA with 32 heads of 128, MLA kv_lora_rank 512 with a 64-wide RoPE key,
163840-token vocabulary, 256 experts top-8). Used for state-size accounting.
"""

from paas_jax.models import GatedDeltaConfig, MLAConfig, ModelConfig, MoEConfig

_MLA_LAYERS = {4, 8, 12, 16, 20, 24, 27}  # 1-based, as in the public config


def get_config() -> ModelConfig:
  pattern = tuple("M" if i + 1 in _MLA_LAYERS else "G" for i in range(27))
  return ModelConfig(
      name="kimi_linear_48b", vocab_size=163_840, d_model=2304, n_layers=27,
      layer_pattern=pattern, d_ff=9216,
      mla=MLAConfig(n_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128),
      gated_delta=GatedDeltaConfig(n_k_heads=32, n_v_heads=32, head_k_dim=128,
                                   head_v_dim=128, gate="kda"),
      moe=MoEConfig(n_experts=256, top_k=8, d_expert=1024, n_shared_experts=1,
                    router="sigmoid"),
      dtype="bfloat16", param_dtype="bfloat16", max_seq_len=1_048_576)
