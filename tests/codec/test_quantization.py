"""Lossy KV quantization: per-channel error bounds, exact recurrent states, logit error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from paas_jax import codec
from paas_jax.codec.testing import random_state
from paas_jax.models import load_config
from paas_jax.models.api import Model, decode_step, prefill
from paas_jax.state import AttentionCache, MLACache, SlidingWindowCache


def roundtrip(state, config, quantization):
  store = codec.MemoryStore()
  manifest = codec.encode_state(state, store, model_id=config.name,
                                config_fingerprint=config.fingerprint(),
                                options=codec.CodecOptions(quantization=quantization))
  like = jax.eval_shape(lambda: jax.tree_util.tree_map(jnp.asarray, state))
  return manifest, codec.decode_state(store, like=like)


@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_swa_gqa"])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_per_channel_error_bound_and_exact_rest(name, quantization):
  config = load_config(name)
  n = 50
  state = random_state(config, [n], capacity=64, seed=11)
  # One outlier channel per cache: per-channel scales must keep the others precise.
  layers = tuple(
      jax.tree_util.tree_map(lambda x: x.copy(), c) for c in state.layers)
  for c in layers:
    if isinstance(c, (AttentionCache, MLACache)):
      first = jax.tree_util.tree_leaves(c)[0]
      first[..., 0] *= 100.0
  state = state.replace(layers=layers)
  manifest, restored = roundtrip(state, config, quantization)
  quantized = 0
  for cache, cache_r, entry in zip(state.layers, restored.layers, manifest.layers):
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(cache_r)):
      a, b = np.asarray(a), np.asarray(b)
      if isinstance(cache, SlidingWindowCache):
        live = min(n, a.shape[1])
        np.testing.assert_array_equal(a[:, :live], b[:, :live])
        continue
      if not isinstance(cache, (AttentionCache, MLACache)):
        # Recurrent states and conv tails stay exact.
        np.testing.assert_array_equal(a, b)
        continue
      quantized += 1
      live, got = a[:, :n].astype(np.float32), b[:, :n].astype(np.float32)
      absmax = np.abs(live).max(axis=1, keepdims=True)
      if quantization == "int8":
        bound = absmax / 127 / 2 * 1.001 + 1e-7
      else:  # e4m3: 3 mantissa bits -> relative step 2^-3, half of it when rounding
        bound = np.maximum(np.abs(live) * 2.0**-4 * 1.001, absmax / 448 * 2.0**-9)
      assert (np.abs(live - got) <= bound).all()
      assert not b[:, n:].any()
      assert {x.stored_dtype for x in entry.arrays if x.role == "data"} == {
          "int8" if quantization == "int8" else np.dtype(ml_dtypes.float8_e4m3fn).name}
  assert quantized > 0


def test_quantized_kv_is_smaller():
  config = load_config("tiny_dense_gqa")
  state = random_state(config, [200], capacity=256)
  exact, _ = roundtrip(state, config, "none")
  int8, _ = roundtrip(state, config, "int8")
  # f32 -> int8 is 4x smaller; per-channel scales add 1 / tokens of that.
  assert int8.nbytes < 0.3 * exact.nbytes


def test_logit_error_of_quantized_state():
  """The decode step after a restored state: exact codec -> identical logits;
  int8 and fp8 -> small, measured error (the numbers bench_transfer reports)."""
  config = load_config("tiny_gdn_gqa")
  model = Model.create(config, seed=0)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, 48)
  _, state = prefill(model, tokens)
  nxt = jnp.array([7])
  ref, _ = decode_step(model, state, nxt)
  ref = np.asarray(ref)
  errors = {}
  for q in ["none", "int8", "fp8"]:
    _, restored = roundtrip(state, config, q)
    logits, _ = decode_step(model, restored, nxt)
    d = np.asarray(logits) - ref
    errors[q] = float(np.linalg.norm(d) / np.linalg.norm(ref))
    assert int(np.argmax(logits)) == int(np.argmax(ref))
  assert errors["none"] == 0.0
  assert 0 < errors["int8"] < 1e-2
  assert errors["int8"] < errors["fp8"] < 5e-2
