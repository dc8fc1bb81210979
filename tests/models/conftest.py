"""Shared tiny models: built once per session so jit caches are reused across tests."""

import functools

import pytest

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, Mamba2Config, MLAConfig,
                             ModelConfig, MoEConfig, load_config)
from paas_jax.models import api

TINY = ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa", "tiny_swa_gqa", "tiny_dense_gqa"]


def mixed_config() -> ModelConfig:
  """Every layer kind in one stack, with MoE and an untied head."""
  return ModelConfig(
      name="test_mixed", vocab_size=97, d_model=48, n_layers=5, layer_pattern="GMSmA",
      d_ff=64,
      attention=AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=12, window=5,
                                output_gate=True, qk_norm=True),
      mla=MLAConfig(n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, q_lora_rank=12),
      gated_delta=GatedDeltaConfig(n_k_heads=1, n_v_heads=2, head_k_dim=8, head_v_dim=12,
                                   gate="kda", chunk_size=16),
      mamba2=Mamba2Config(n_heads=2, head_dim=8, d_state=8, n_groups=1, chunk_size=16),
      moe=MoEConfig(n_experts=3, top_k=2, d_expert=16),
      tie_embeddings=False, max_seq_len=512)


ALL_MODELS = TINY + ["test_mixed"]


@functools.cache
def get_model(name: str) -> api.Model:
  config = mixed_config() if name == "test_mixed" else load_config(name)
  return api.Model.create(config, seed=0)


@pytest.fixture(params=ALL_MODELS)
def model(request) -> api.Model:
  return get_model(request.param)


def sweep(values_for_mixed, value_for_others):
  """(model name, value) pairs: the whole sweep on the all-kinds model, one
  point on each single-family model (their kinds are all inside test_mixed)."""
  pairs = [("test_mixed", v) for v in values_for_mixed]
  return pairs + [(name, value_for_others) for name in TINY]
