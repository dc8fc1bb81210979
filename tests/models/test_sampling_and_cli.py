"""Sampling, generation and the generate CLI."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from paas_jax.models import api, load_config


def _keys(n, seed=0):
  keys = api.sampling_keys(seed, jnp.arange(n))
  assert jnp.array_equal(jax.random.key_data(keys[5]),
                         jax.random.key_data(api.sampling_key(seed, 5)))
  return keys


def test_greedy_and_degenerate_filters_take_argmax():
  logits = jax.random.normal(jax.random.key(0), (6, 50))
  argmax = np.asarray(jnp.argmax(logits, -1))
  n = logits.shape[0]
  greedy = api.sample_tokens(logits, _keys(n), jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.ones(n))
  top1 = api.sample_tokens(logits, _keys(n), jnp.ones(n), jnp.ones(n, jnp.int32), jnp.ones(n))
  tiny_p = api.sample_tokens(logits, _keys(n), jnp.ones(n), jnp.zeros(n, jnp.int32),
                             jnp.full(n, 1e-6))
  for got in (greedy, top1, tiny_p):
    np.testing.assert_array_equal(got, argmax)


def test_top_k_never_leaves_the_top_k_and_is_deterministic():
  logits = jax.random.normal(jax.random.key(1), (1, 40)).repeat(256, 0)
  n = logits.shape[0]
  keys = _keys(n, seed=3)
  got = api.sample_tokens(logits, keys, jnp.full(n, 2.0), jnp.full(n, 5, jnp.int32), jnp.ones(n))
  top5 = set(np.argsort(-np.asarray(logits[0]))[:5].tolist())
  assert set(np.asarray(got).tolist()) <= top5
  assert len(set(np.asarray(got).tolist())) > 1  # it does sample
  again = api.sample_tokens(logits, keys, jnp.full(n, 2.0), jnp.full(n, 5, jnp.int32), jnp.ones(n))
  np.testing.assert_array_equal(got, again)


def test_sampling_follows_the_distribution():
  probs = np.array([0.5, 0.3, 0.2])
  logits = jnp.log(jnp.asarray(probs))[None].repeat(4000, 0)
  n = logits.shape[0]
  got = np.asarray(api.sample_tokens(logits, _keys(n), jnp.ones(n), jnp.zeros(n, jnp.int32),
                                     jnp.ones(n)))
  freq = np.bincount(got, minlength=3) / n
  np.testing.assert_allclose(freq, probs, atol=0.03)
  # top_p=0.6 keeps the two most likely tokens only.
  got = np.asarray(api.sample_tokens(logits, _keys(n), jnp.ones(n), jnp.zeros(n, jnp.int32),
                                     jnp.full(n, 0.6)))
  assert set(got.tolist()) == {0, 1}


def test_generate_is_deterministic_and_respects_stop_tokens():
  model = api.Model.create(load_config("tiny_gdn_gqa"))
  params = api.SamplingParams(temperature=1.0, top_k=20)
  a = api.generate(model, [1, 2, 3], 8, sampling=params, seed=7)
  b = api.generate(model, [1, 2, 3], 8, sampling=params, seed=7)
  assert a.tokens == b.tokens and len(a.tokens) == 8
  stop = a.tokens[3]
  c = api.generate(model, [1, 2, 3], 8, sampling=params, seed=7, stop_tokens=[stop])
  assert c.tokens == a.tokens[:a.tokens.index(stop) + 1]
  assert c.stop_reason == "stop_token"


def test_generate_cli_prints_json():
  out = subprocess.run(
      [sys.executable, "-m", "paas_jax.generate", "--config=tiny_gdn_gqa",
       "--prompt_ids=1,2,3", "--max_new_tokens=5", "--json"],
      capture_output=True, text=True, timeout=300, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(result) >= {"tokens", "prefill_s", "decode_tokens_per_s"}
  model = api.Model.create(load_config("tiny_gdn_gqa"))
  assert result["tokens"] == api.generate(model, [1, 2, 3], 5).tokens


def test_generate_cli_rejects_bad_input_cleanly():
  out = subprocess.run(
      [sys.executable, "-m", "paas_jax.generate", "--config=tiny_gdn_gqa",
       "--prompt_ids=1,99999", "--max_new_tokens=5"],
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  assert "error:" in out.stderr and "Traceback" not in out.stderr
