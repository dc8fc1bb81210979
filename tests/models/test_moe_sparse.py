"""Sparse MoE dispatch equals the dense evaluation, for every family's routing.

The tiny configs mirror the three imported families' MoE settings (see
``tests/checkpoints/hf_tiny.py`` and ``checkpoints/hf_families.py``):
Qwen3-Next (softmax top-k, renormalised, gated shared expert), Kimi Linear
(grouped sigmoid with a balancing bias, routed scale, f32 router, shared
expert) and Nemotron-H (relu² experts, sigmoid with bias, routed scale), plus
the repository's ``tiny_kda_mla``. Logits are compared in fp32: the two
paths differ only in float summation order, so the bound is 2e-5 of the
logit scale; each comparison has a negative control.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, Mamba2Config, MLAConfig,
                             ModelConfig, MoEConfig, api, load_config, moe_dispatch)
from paas_jax.models.layers import MoE
from pallas_kernels import last_impl

TOL = 2e-5


def qwen3_next_like() -> ModelConfig:
  return ModelConfig(
      name="tiny_moe_qwen3_next", vocab_size=64, d_model=32, n_layers=4, layer_pattern="GAGA",
      d_ff=48, ffn_pattern="edee",
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, output_gate=True,
                                qk_norm=True, rope_fraction=0.5),
      gated_delta=GatedDeltaConfig(n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=8),
      moe=MoEConfig(n_experts=8, top_k=2, d_expert=16, n_shared_experts=1, d_shared=24,
                    shared_gate=True, router="softmax", normalize_top_k=True),
      norm_plus_one=True, max_seq_len=256)


def kimi_linear_like() -> ModelConfig:
  return ModelConfig(
      name="tiny_moe_kimi_linear", vocab_size=64, d_model=32, n_layers=4, layer_pattern="GMGM",
      d_ff=48, ffn_pattern="deee",
      mla=MLAConfig(n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, use_rope=False),
      gated_delta=GatedDeltaConfig(n_k_heads=4, n_v_heads=4, head_k_dim=8, head_v_dim=8,
                                   gate="kda"),
      moe=MoEConfig(n_experts=8, top_k=2, d_expert=16, n_shared_experts=1, router="sigmoid",
                    normalize_top_k=True, score_correction_bias=True, n_groups=2,
                    top_k_groups=1, routed_scale=2.446, router_in_fp32=True),
      max_seq_len=256)


def nemotron_h_like() -> ModelConfig:
  return ModelConfig(
      name="tiny_moe_nemotron_h", vocab_size=64, d_model=32, n_layers=4, layer_pattern="mAmm",
      d_ff=48, ffn_pattern="de--", ffn_activation="relu2",
      attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8, use_rope=False),
      mamba2=Mamba2Config(n_heads=4, head_dim=8, d_state=8, n_groups=2, chunk_size=16),
      moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared_experts=1, d_shared=24,
                    router="sigmoid", score_correction_bias=True, routed_scale=1.5,
                    router_in_fp32=True),
      max_seq_len=256)


FAMILIES = {"qwen3_next": qwen3_next_like, "kimi_linear": kimi_linear_like,
            "nemotron_h": nemotron_h_like, "tiny_kda_mla": lambda: load_config("tiny_kda_mla")}


def _randomize_bias(model: api.Model, seed: int) -> api.Model:
  """Gives balancing biases (zero at init) values that change some choices."""
  module = model.module()
  rng = np.random.default_rng(seed)
  for block in module.blocks:
    if isinstance(block.ffn, MoE) and block.ffn.score_bias is not None:
      bias = rng.uniform(-0.1, 0.1, block.ffn.score_bias.shape).astype(np.float32)
      block.ffn.score_bias[...] = jnp.asarray(bias)
  return api.Model.from_module(module)


@functools.cache
def family_model(family: str) -> api.Model:
  return _randomize_bias(api.Model.create(FAMILIES[family](), seed=0), seed=1)


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got))
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def ragged_batch(vocab: int):
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, vocab, size=(3, 21)).astype(np.int32)
  return tokens, [21, 9, 14]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_equals_dense_logits(family):
  model = family_model(family)
  assert model.config.moe is not None
  tokens, lengths = ragged_batch(model.config.vocab_size)
  sparse = api.prefill(model, tokens, lengths=lengths)[0]
  assert last_impl("grouped_matmul") == "xla"  # the default is sparse (and XLA on CPU)
  dense = api.prefill(model.with_moe_dispatch("dense"), tokens, lengths=lengths)[0]
  for i, n in enumerate(lengths):  # logits of the real tokens
    assert rel_err(sparse[i, :n], dense[i, :n]) <= TOL


def test_decode_sparse_equals_dense():
  model = family_model("kimi_linear")
  tokens, lengths = ragged_batch(model.config.vocab_size)
  feed = np.asarray([5, 6, 7], np.int32)
  out = {}
  for name, variant in (("sparse", model), ("dense", model.with_moe_dispatch("dense"))):
    state = api.prefill(variant, tokens, lengths=lengths)[1]
    steps = []
    for _ in range(2):
      logits, state = api.decode_step(variant, state, feed)
      steps.append(np.asarray(logits))
    out[name] = steps
  for s, d in zip(out["sparse"], out["dense"]):
    assert rel_err(s, d) <= TOL


# -- one MoE layer (cheap to compile): negative controls, bf16, Pallas interpret ----

@functools.cache
def family_layer(family: str) -> tuple[nnx.GraphDef, nnx.State]:
  """The first MoE layer of the family's model, split for jitting."""
  model = family_model(family)
  module = model.module()
  return nnx.split(next(b.ffn for b in module.blocks if isinstance(b.ffn, MoE)))


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _layer_call(graphdef, params, dispatch, impl, x):
  layer = nnx.merge(graphdef, params)
  layer.dispatch, layer.impl = dispatch, impl
  return layer(x)


def layer_outputs(family, x, dispatch, impl="auto", **routing_changes):
  graphdef, params = family_layer(family)
  if routing_changes:
    layer = nnx.merge(graphdef, params)
    layer.moe = dataclasses.replace(layer.moe, **routing_changes)
    graphdef, params = nnx.split(layer)
  return np.asarray(_layer_call(graphdef, params, dispatch, impl, x))


def layer_input(family, tokens=40, dtype=np.float32):
  d = family_model(family).config.d_model
  return np.random.default_rng(3).standard_normal((2, tokens, d)).astype(dtype)


@pytest.mark.parametrize("family,change", [
    ("qwen3_next", {"normalize_top_k": False}),
    ("kimi_linear", {"normalize_top_k": False}),
    ("kimi_linear", {"routed_scale": 1.0}),
    ("nemotron_h", {"n_groups": 2, "top_k_groups": 1})])
def test_negative_control_wrong_routing_is_detected(family, change):
  # The comparison that passes above fails when the sparse path routes differently.
  x = layer_input(family)
  dense = layer_outputs(family, x, "dense")
  assert rel_err(layer_outputs(family, x, "sparse"), dense) <= TOL
  assert rel_err(layer_outputs(family, x, "sparse", **change), dense) > 100 * TOL


@pytest.mark.parametrize("impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_pallas_interpret_dispatch_equals_dense(impl):
  x = layer_input("kimi_linear", tokens=24)
  dense = layer_outputs("kimi_linear", x, "dense")
  assert rel_err(layer_outputs("kimi_linear", x, "sparse", impl=impl), dense) <= TOL
  assert last_impl("grouped_matmul") == impl


def test_bf16_sparse_close_to_dense():
  x = layer_input("qwen3_next").astype(jnp.bfloat16)
  # bf16 rounds each path's products differently; errors stay at bf16 scale.
  assert rel_err(layer_outputs("qwen3_next", x, "sparse").astype(np.float32),
                 layer_outputs("qwen3_next", x, "dense").astype(np.float32)) <= 3e-2


def test_every_assignment_is_computed_even_when_one_expert_takes_all():
  # No capacity, no dropping: a router biased hard towards expert 0 (every
  # token picks it) still matches the dense evaluation.
  graphdef, params = family_layer("kimi_linear")
  layer = nnx.merge(graphdef, params)
  bias = np.zeros(layer.score_bias.shape, np.float32)
  bias[0] = 10.0
  layer.score_bias[...] = jnp.asarray(bias)
  graphdef, params = nnx.split(layer)
  x = layer_input("kimi_linear")
  idx, _ = jax.jit(lambda p, v: nnx.merge(graphdef, p).route(v))(params, x)
  assert np.all(np.any(np.asarray(idx) == 0, axis=-1))
  assert rel_err(_layer_call(graphdef, params, "sparse", "auto", x),
                 _layer_call(graphdef, params, "dense", "auto", x)) <= TOL


def test_route_matches_numpy_grouped_sigmoid():
  # Routing itself, spelled out in numpy (DeepSeek-V3 / Kimi): sigmoid scores,
  # bias for choice only, best group by its top-2 sum, renormalise, scale.
  moe = kimi_linear_like().moe
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, moe.n_experts)).astype(np.float32)
  bias = rng.uniform(-0.2, 0.2, moe.n_experts).astype(np.float32)
  idx, w = jax.jit(moe_dispatch.route, static_argnums=0)(moe, logits, bias)
  scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  choice = scores + bias
  per = moe.n_experts // moe.n_groups
  for t in range(6):
    groups = choice[t].reshape(moe.n_groups, per)
    best = np.argmax(np.sort(groups, axis=-1)[:, -2:].sum(-1))
    masked = np.full(moe.n_experts, -np.inf)
    masked[best * per:(best + 1) * per] = choice[t, best * per:(best + 1) * per]
    top = np.argsort(-masked)[:moe.top_k]
    want = scores[t, top] / scores[t, top].sum() * moe.routed_scale
    assert sorted(np.asarray(idx[t]).tolist()) == sorted(top.tolist())
    order = np.argsort(np.asarray(idx[t]))
    np.testing.assert_allclose(np.asarray(w[t])[order], want[np.argsort(top)], rtol=1e-5)


def test_bad_dispatch_raises():
  model = family_model("nemotron_h")
  with pytest.raises(ValueError, match="dispatch"):
    model.with_moe_dispatch("capacity")
