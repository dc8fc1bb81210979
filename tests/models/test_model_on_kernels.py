"""The whole model on its Pallas kernels (interpret mode) == the XLA path.

Every layer kind (G M S m A) and sparse MoE in one stack, prefill of a ragged
batch then decode steps, with every kernel op on ``pallas_tpu_interpret`` or
``pallas_gpu_interpret`` (``Model.with_kernel_impl``): logits match the XLA
model's, and each op records the Pallas path it took. The first GPU/TPU run of
the model is then not the first time model and kernels meet. Slow: the Pallas
interpreter runs every grid step in Python (minutes on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, Mamba2Config, MLAConfig,
                             ModelConfig, MoEConfig, api)
from pallas_kernels import last_impl

PREFILL_OPS = ("chunk_gated_delta", "flash_attention", "ssd", "grouped_matmul")
DECODE_OPS = ("paged_attention", "paged_mla_attention", "flash_attention", "grouped_matmul")
# One recurrent decode token is a few fused elementwise ops and mat-vecs: every impl runs
# the same jnp code and records "xla" (pallas_kernels/{gated_delta,ssd}/ops.py).
JNP_STEP_OPS = ("gated_delta_step", "ssd_step")
TOL = dict(rtol=1e-4, atol=1e-4)


def kernel_config() -> ModelConfig:
  """Every layer kind and MoE, with power-of-two head dims (the GPU paged kernels need
  them) and chunk sizes the prompt crosses."""
  return ModelConfig(
      name="kernel_mixed", vocab_size=97, d_model=64, n_layers=5, layer_pattern="GMSmA",
      d_ff=64,
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, window=8,
                                output_gate=True, qk_norm=True),
      mla=MLAConfig(n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=16, q_lora_rank=16),
      gated_delta=GatedDeltaConfig(n_k_heads=1, n_v_heads=2, head_k_dim=16, head_v_dim=16,
                                   gate="kda", chunk_size=16),
      mamba2=Mamba2Config(n_heads=2, head_dim=16, d_state=16, n_groups=1, chunk_size=16),
      moe=MoEConfig(n_experts=4, top_k=2, d_expert=32),
      tie_embeddings=False, max_seq_len=256)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_whole_model_on_pallas_kernels_matches_xla(impl):
  xla = api.Model.create(kernel_config(), seed=0).with_kernel_impl("xla")
  tokens = np.random.RandomState(0).randint(0, 97, (2, 40)).astype(np.int32)
  lengths = [40, 29]
  want, want_state = api.prefill(xla, tokens, lengths=lengths)
  feed = np.array([3, 5], np.int32)
  want_step, _ = api.decode_step(xla, want_state, feed)

  pallas = xla.with_kernel_impl(impl)
  got, state = api.prefill(pallas, tokens, lengths=lengths)
  assert {op: last_impl(op) for op in PREFILL_OPS} == {op: impl for op in PREFILL_OPS}
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(got[row, :n]), np.asarray(want[row, :n]), **TOL)
  got_step, _ = api.decode_step(pallas, state, feed)
  assert {op: last_impl(op) for op in DECODE_OPS} == {op: impl for op in DECODE_OPS}
  assert {op: last_impl(op) for op in JNP_STEP_OPS} == {op: "xla" for op in JNP_STEP_OPS}
  np.testing.assert_allclose(np.asarray(got_step), np.asarray(want_step), **TOL)
  # Negative control: the same comparison fails on a wrong decode input.
  wrong, _ = api.decode_step(pallas, state, feed[::-1])  # rows fed each other's token
  assert not np.allclose(np.asarray(wrong), np.asarray(want_step), **TOL)
