"""Tensor-parallel state transfer without a gather (``--tp=8``, 8 fake CPU devices).

A TP=8 prefill state of ``tiny_gdn_gqa_8h`` (every layer's state split by head
over the 8 devices) is encoded shard by shard from each device's buffer (a
gather would read the whole array through ``__array__``: refused here), its
manifest records the source sharding and its chunks lie inside one shard; the
receiver restores it in its own layout (here the host, TP=1) bit for bit, and
the handoff logit probe made at TP=8 passes on it. Negative control: a state
whose shards sit in the wrong device order fails the probe. Slow: the real
prefill and decode servers at ``--tp=8`` give TP=1's tokens and logprobs.
"""

from __future__ import annotations

import functools

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from paas_jax.client import BrokerClient
from paas_jax.codec import MemoryStore, decode_state, encode_groups, wire_arrays
from paas_jax.codec.encode import build_manifest
from paas_jax.codec.manifest import MANIFEST_KEY
from paas_jax.codec.options import CodecOptions
from paas_jax.models import api
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common, logprob_check, tensor_parallel
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import RequestParams
from paas_jax.state import abstract_state, logit_probe, round_up

common.enable_compilation_cache(common.default_compilation_cache())

CONFIG = "tiny_gdn_gqa_8h"
PROMPT = tuple(int(t) for t in np.random.default_rng(8).integers(0, 256, 45))


@functools.cache
def _model(tp: int) -> api.Model:
  return common.load_model(CONFIG, seed=0, tp=tp)[0]


def _refuse_gathers(monkeypatch, allow_last_dim: int | None = None) -> None:
  """From now on, reading an array spread over several devices as one host array
  (a gather) raises, except arrays whose last axis is ``allow_last_dim`` (logits);
  one device's buffer (one shard) reads as before."""
  impl = type(jax.device_put(np.zeros(2)))
  real = impl.__array__

  def guarded(self, *args, **kwargs):
    if len(self.sharding.device_set) > 1 and (
        not self.ndim or self.shape[-1] != allow_last_dim):
      raise AssertionError(f"gathered an array of shape {self.shape} spread over "
                           f"{len(self.sharding.device_set)} devices")
    return real(self, *args, **kwargs)
  monkeypatch.setattr(impl, "__array__", guarded)


def _ship(state, length: int):
  """Encodes ``state`` (a TP=8 device state) as the prefill servers do (each leaf
  through ``wire_arrays``), stores the objects and restores them on the host (the
  receiver's own layout)."""
  store, entries = MemoryStore(), []
  for group in encode_groups(wire_arrays(state), options=CodecOptions(),
                             token_count=length):
    store.put_many(group.blobs)
    entries.append(group.entry)
  cfg = _model(1).config
  manifest = build_manifest(entries, model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                            token_count=length, batch=1, options=CodecOptions())
  store.put_many({MANIFEST_KEY: manifest.to_json().encode()})
  like = abstract_state(cfg, 1, round_up(length))
  return manifest, decode_state(store, like=like, expected_fingerprint=cfg.fingerprint())


def _swap_shards(x: jax.Array, a: int, b: int) -> jax.Array:
  """``x`` with the buffers of devices ``a`` and ``b`` exchanged (a head order bug)."""
  shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
  bufs = [s.data for s in shards]
  bufs[a], bufs[b] = (jax.device_put(bufs[b], shards[a].device),
                      jax.device_put(bufs[a], shards[b].device))
  return jax.make_array_from_single_device_arrays(
      x.shape, x.sharding, [bufs[i] for i in range(len(shards))])


def test_tp8_state_is_sent_shard_by_shard_and_restores_exactly(monkeypatch):
  eight, one = _model(8), _model(1)
  assert tensor_parallel.tp_degree(eight) == 8
  logits, state = api.prefill(eight, np.asarray(PROMPT, np.int32))
  first = int(np.argmax(np.asarray(logits[0, -1])))
  probe = logit_probe.make_probe(eight, state, first)
  sharded = [x for x in jax.tree_util.tree_leaves(state.layers)
             if isinstance(x.sharding, NamedSharding) and "tp" in x.sharding.spec]
  assert len(sharded) == 2 * len(state.layers)  # every layer's state, split by head
  _refuse_gathers(monkeypatch)
  manifest, got = _ship(state, len(PROMPT))
  monkeypatch.undo()
  recorded = [a for g in manifest.layers for a in g.arrays if a.source_sharding]
  assert len(recorded) == len(sharded)
  for a in recorded:
    assert a.source_sharding["mesh"] == {"tp": 8}
    axis = a.source_sharding["spec"].index("tp")
    assert (a.shape[axis] // 8) % a.chunk_shape[axis] == 0, a  # each chunk inside a shard
  # The restored host state equals the TP=8 state bit for bit and TP=1's own
  # prefill closely.
  _, ref = api.prefill(one, np.asarray(PROMPT, np.int32))
  for g, s, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(state),
                     jax.tree_util.tree_leaves(ref)):
    cut = tuple(slice(0, n) for n in np.shape(g))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(s)[cut])
    np.testing.assert_allclose(np.asarray(g), np.asarray(r)[cut], rtol=1e-4, atol=1e-4)
  # The handoff probe made at TP=8 passes on the state restored for TP=1.
  assert logit_probe.check_state(one, got, probe).ok
  # Negative control of the guard: gathering the state is refused.
  _refuse_gathers(monkeypatch)
  with pytest.raises(AssertionError, match="gathered"):
    np.asarray(sharded[0])


def test_swapped_shard_order_is_caught_by_the_probe():
  """Negative control: the same state with two devices' shards exchanged in every
  head-split leaf decodes without a codec error (every chunk is intact) but
  fails the handoff probe, while the correct order passes."""
  eight, one = _model(8), _model(1)
  logits, state = api.prefill(eight, np.asarray(PROMPT, np.int32))
  first = int(np.argmax(np.asarray(logits[0, -1])))
  probe = logit_probe.make_probe(eight, state, first)
  swapped = state.replace(layers=jax.tree_util.tree_map(
      lambda x: _swap_shards(x, 0, 3) if "tp" in x.sharding.spec else x, state.layers))
  _, good = _ship(state, len(PROMPT))
  _, bad = _ship(swapped, len(PROMPT))
  assert logit_probe.check_state(one, good, probe).ok
  result = logit_probe.check_state(one, bad, probe)
  assert not result.ok, result


def _decode_stats(cluster) -> dict:
  with grpc.insecure_channel(cluster.decode_address) as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return dict(r.gauges)


@pytest.mark.slow
def test_tp8_servers_give_tp1_tokens_and_logprobs(tmp_path):
  """Prefill and decode servers with --tp=8 (real processes, broker, WAN relay):
  remote (PrfaaS, the state sent shard by shard) and local (PD-P) prefill give the
  single-process TP=1 tokens and logprobs."""
  spec = ClusterSpec(config=CONFIG, seed=0, n_slots=2, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=2, threshold=40, tp=8,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  one = _model(1)
  cases = [(PROMPT + PROMPT[:30], "remote", 0.0, 0), (PROMPT[:20], "local", 0.0, 0),
           (PROMPT, "remote", 0.9, 5)]
  with LocalCluster(spec, tmp_path) as cluster, BrokerClient(cluster.broker_address,
                                                             timeout_s=300) as client:
    for prompt, route, temperature, seed in cases:
      out = client.generate(prompt_ids=prompt, max_new_tokens=10, temperature=temperature,
                            seed=seed, route=route, logprobs=True)
      want = api.generate(one, prompt, 10, sampling=api.SamplingParams(temperature, 0, 1.0),
                          seed=seed).tokens
      assert out.tokens == want, (route, temperature)
      assert out.route == ("prfaas" if route == "remote" else "pdp")
      cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
          one, list(prompt), out.tokens))
      assert cmp.ok and cmp.steps == len(out.tokens), cmp
    # The decode side received head-split arrays as the prefill side's shards.
    assert _decode_stats(cluster)["sharded_arrays_in"] > 0


def test_tp8_prefill_engine_keeps_the_state_on_its_devices(monkeypatch):
  """The prefill engine's outputs keep head-split leaves on their devices (no gather
  while prefilling, slicing rows or making the handoff probe); the probe made from
  them passes on the TP=1 engine's own output."""
  eight, one = _model(8), _model(1)
  engine = PrefillEngine(eight, EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,),
                                             prefill_max_batch=2))
  ref = PrefillEngine(one, EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,),
                                        prefill_max_batch=2))
  inputs = [PrefillInput("a", PROMPT, RequestParams()), PrefillInput("b", PROMPT[:20],
                                                                     RequestParams())]
  engine.prefill(inputs)  # compiles
  _refuse_gathers(monkeypatch, allow_last_dim=eight.config.vocab_size)  # logits are read
  outs = engine.prefill(inputs)
  monkeypatch.undo()
  want = ref.prefill(inputs)
  for out, w in zip(outs, want):
    leaves = jax.tree_util.tree_leaves(out.state.layers)
    assert all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 8 for x in leaves)
    assert out.first_token == w.first_token
    probe = logit_probe.make_probe(eight, out.state, out.first_token)
    assert logit_probe.check_state(one, w.state, probe).ok
