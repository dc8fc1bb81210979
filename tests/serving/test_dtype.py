"""bf16 serving (``--dtype=bfloat16``): weights, activations and KV cache in
bf16, recurrent states f32, logits close to f32 on the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax.models.logit_error import logit_error
from paas_jax.serving import common
from paas_jax.state import init_state


@pytest.fixture(scope="module")
def models():
  f32, _ = common.load_model("tiny_gdn_gqa", 0)
  return f32, common.with_dtype(f32, "bfloat16")


def test_weights_and_state_dtypes(models):
  f32, bf16 = models
  assert bf16.config.dtype == bf16.config.param_dtype == "bfloat16"
  leaves = jax.tree_util.tree_leaves(bf16.params)
  assert any(x.dtype == jnp.bfloat16 for x in leaves)
  assert all(x.dtype in (jnp.bfloat16, jnp.float32) for x in leaves)
  state = init_state(bf16.config, 1, 16)
  for kind, layer in zip(bf16.config.layer_kinds, state.layers):
    # KV caches (A) in bf16; Gated DeltaNet (G): the recurrent state in f32,
    # the short conv window in the activation dtype.
    if kind == "A":
      assert layer.k.dtype == layer.v.dtype == jnp.bfloat16
    else:
      assert layer.recurrent.dtype == jnp.float32 and layer.conv.dtype == jnp.bfloat16
  assert common.with_dtype(f32, "float32") is f32


def test_logit_error_small_but_real(models):
  f32, bf16 = models
  prompt = list(np.random.default_rng(0).integers(0, 256, 48))
  r = logit_error(f32, bf16, prompt, 4)
  assert 0 < r["max_rel_error"] < 0.05 and r["top1_agreement"] > 0.8
  # Control: other weights (seed 1) are far off, so the bound can fail.
  other = common.with_dtype(common.load_model("tiny_gdn_gqa", 1)[0], "bfloat16")
  assert logit_error(f32, other, prompt, 0)["max_rel_error"] > 0.2
