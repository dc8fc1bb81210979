"""Tensor-parallel serving (``--tp``, serving/tensor_parallel.py): TP=N == TP=1 tokens.

Default suite, in process (8 fake CPU devices, tests/conftest.py): a TP=2 model's
prefill logits and generated tokens equal TP=1's; a TP=2 model with one parameter
shard damaged does not (negative control). Slow: the serving engines (batched
chunked prefill, paged decode pool) on TP=2 and TP=4, and the real servers with
``--tp=2`` behind the broker, give the TP=1 tokens, greedy and sampled.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec

from paas_jax.checkpoints.hf_import import model_from_params
from paas_jax.client import BrokerClient
from paas_jax.netem import LinkSpec
from paas_jax.models import api
from paas_jax.serving import common, tensor_parallel
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import RequestParams
from tests.serving.engine_rig import decode_to_completion

common.enable_compilation_cache(common.default_compilation_cache())

CONFIG = "tiny_gdn_gqa"
ENGINE = EngineConfig(n_slots=2, max_ctx=128, page_size=16, prefill_buckets=(64,),
                      prefill_max_batch=2)


@functools.cache
def _model(tp: int) -> api.Model:
  return common.load_model(CONFIG, seed=0, tp=tp)[0]


def _requests(vocab: int) -> list[PrefillInput]:
  rng = np.random.default_rng(3)
  samplings = [api.SamplingParams(0.0, 0, 1.0), api.SamplingParams(0.9, 20, 0.95)]
  return [PrefillInput(f"r{i}", tuple(int(t) for t in rng.integers(0, vocab, n)),
                       RequestParams(samplings[i % 2], seed=7 + i, max_new_tokens=8))
          for i, n in enumerate((70, 23, 41))]


def _serve(model: api.Model, reqs: list[PrefillInput]) -> dict[str, list[int]]:
  """Prefill in batches of two, then decode every request to its end."""
  pe, de = PrefillEngine(model, ENGINE), DecodeEngine(model, ENGINE)
  outs = pe.prefill(reqs[:2]) + pe.prefill(reqs[2:])
  return decode_to_completion(de, list(zip(reqs, outs)))


PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 256, 45)]


def _damaged(model: api.Model) -> api.Model:
  """``model`` with the second device's rows of a row-parallel kernel zeroed."""
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(model.params))
  key = ("blocks", 3, "mixer", "o_proj", "kernel")
  x = np.asarray(flat[key]).copy()
  x[x.shape[0] // 2:] = 0.0
  damaged = dict(flat)
  damaged[key] = jax.device_put(x, flat[key].sharding)
  return model_from_params(model.config, damaged, {k: v.sharding for k, v in flat.items()})


def test_tp2_model_gives_tp1_logits_and_tokens():
  one, two = _model(1), _model(2)
  assert tensor_parallel.tp_degree(one) == 1 and tensor_parallel.tp_degree(two) == 2
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(two.params))
  assert flat["embed", "embedding"].sharding.spec == PartitionSpec("tp", None)   # vocabulary
  assert flat["blocks", 3, "mixer", "o_proj", "kernel"].sharding.spec == PartitionSpec("tp", None)
  assert flat["blocks", 3, "mixer", "q_proj", "kernel"].sharding.spec == PartitionSpec(None, "tp")
  a, _ = api.prefill(one, PROMPT)
  b, state = api.prefill(two, PROMPT)
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
  assert len(jax.tree_util.tree_leaves(state)[0].sharding.device_set) == 2  # state on the mesh
  assert (api.generate(two, PROMPT, 8).tokens == api.generate(one, PROMPT, 8).tokens)
  # Negative control: one damaged shard is caught by the same comparison.
  c, _ = api.prefill(_damaged(two), PROMPT)
  assert not np.allclose(np.asarray(c), np.asarray(a), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_engines_give_tp1_tokens(tp):
  reqs = _requests(_model(1).config.vocab_size)
  want = _serve(_model(1), reqs)
  assert _serve(_model(tp), reqs) == want
  assert _serve(_damaged(_model(2)), reqs[:2]) != {k: want[k] for k in ("r0", "r1")}


@pytest.mark.slow
def test_tp2_servers_give_tp1_tokens(tmp_path):
  """Prefill and decode servers started with --tp=2 (real processes, broker, WAN relay):
  remote (PrfaaS) and local (PD-P) prefill give the single-process TP=1 tokens."""
  spec = ClusterSpec(config=CONFIG, seed=0, n_slots=2, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=2, threshold=40, tp=2,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  one = _model(1)
  cases = [(PROMPT + PROMPT[:30], "remote", 0.0, 0), (PROMPT[:20], "local", 0.0, 0),
           (PROMPT, "remote", 0.9, 5)]
  with LocalCluster(spec, tmp_path) as cluster, BrokerClient(cluster.broker_address,
                                                             timeout_s=300) as client:
    for prompt, route, temperature, seed in cases:
      out = client.generate(prompt_ids=prompt, max_new_tokens=10, temperature=temperature,
                            seed=seed, route=route)
      want = api.generate(one, prompt, 10, sampling=api.SamplingParams(temperature, 0, 1.0),
                          seed=seed).tokens
      assert out.tokens == want, (route, temperature)
      assert out.route == ("prfaas" if route == "remote" else "pdp")


def test_tp_beyond_the_hosts_devices_is_refused_clearly():
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    tensor_parallel.local_mesh(len(jax.local_devices()) + 1)
  with pytest.raises(ValueError, match=">= 1"):
    tensor_parallel.local_mesh(0)
