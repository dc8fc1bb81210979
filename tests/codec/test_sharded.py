"""Sharded encode (shard by shard, no gather) and restore into another mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paas_jax import codec
from paas_jax.state import AttentionCache, DecodeState, GatedDeltaCache


def _mesh(n):
  devices = jax.devices()
  assert len(devices) >= 8, "tests/conftest.py must set 8 fake CPU devices"
  return Mesh(np.array(devices[:n]), ("tp",))


def _kv_spec():
  return P(None, None, "tp", None)


def _rec_spec():
  return P(None, "tp", None, None)


def make_state(mesh, n_tokens=100, capacity=256):
  key = jax.random.PRNGKey(0)
  ks = jax.random.split(key, 4)
  k = jax.random.normal(ks[0], (1, capacity, 8, 16), jnp.bfloat16)
  v = jax.random.normal(ks[1], (1, capacity, 8, 16), jnp.bfloat16)
  conv = jax.random.normal(ks[2], (1, 3, 24), jnp.bfloat16)
  rec = jax.random.normal(ks[3], (1, 8, 16, 16), jnp.float32)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  return DecodeState(
      layers=(AttentionCache(put(k, _kv_spec()), put(v, _kv_spec())),
              GatedDeltaCache(put(conv, P()), put(rec, _rec_spec()))),
      lengths=put(jnp.array([n_tokens], jnp.int32), P()))


def shardings_for(mesh):
  def fn(name, leaf):
    if name.startswith("layers/0/"):
      return NamedSharding(mesh, _kv_spec())
    if name == "layers/1/recurrent":
      return NamedSharding(mesh, _rec_spec())
    return NamedSharding(mesh, P())
  return fn


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("decode_tp", [2, 1])
def test_tp8_to_smaller_mesh(decode_tp, quantization):
  state = make_state(_mesh(8))
  store = codec.MemoryStore()
  manifest = codec.encode_state(state, store, model_id="m", config_fingerprint="f",
                                options=codec.CodecOptions(quantization=quantization))
  k_entry = manifest.layers[0].array("layers/0/k")
  # Each chunk lies inside one device's shard (1 head of 8): no two devices
  # (or processes) ever write the same object.
  assert k_entry.chunk_shape[2] == 1
  assert len([c for c in k_entry.chunks if not c.key.endswith("zarr.json")]) == 8
  # The replicated conv tail is written once, not once per device.
  conv = manifest.layers[1].array("layers/1/conv")
  assert len([c for c in conv.chunks if not c.key.endswith("zarr.json")]) == 1

  mesh = _mesh(decode_tp)
  like = jax.eval_shape(lambda: state)
  restored = codec.decode_state(store, like=like, shardings=shardings_for(mesh))
  k = restored.layers[0].k
  assert k.sharding == NamedSharding(mesh, _kv_spec())
  assert [s.data.shape for s in k.addressable_shards] == [(1, 256, 8 // decode_tp, 16)] * decode_tp
  ref = np.asarray(state.layers[0].k.astype(jnp.float32))
  got = np.asarray(k.astype(jnp.float32))
  if quantization == "none":
    np.testing.assert_array_equal(got[:, :100], ref[:, :100])
  else:
    np.testing.assert_allclose(got[:, :100], ref[:, :100], atol=0.05, rtol=0.02)
  assert not got[:, 100:].any()
  np.testing.assert_array_equal(np.asarray(restored.layers[1].recurrent),
                                np.asarray(state.layers[1].recurrent))
  assert restored.layers[1].recurrent.sharding == NamedSharding(mesh, _rec_spec())
  np.testing.assert_array_equal(np.asarray(restored.lengths), [100])


def test_shardings_pytree_and_template_shardings():
  state = make_state(_mesh(8), n_tokens=17)
  store = codec.MemoryStore()
  codec.encode_state(state, store, model_id="m", config_fingerprint="f")
  mesh = _mesh(2)
  fn = shardings_for(mesh)
  like = jax.eval_shape(lambda: state)
  names = [n for n, _ in codec.layout.named_leaves(like)]
  tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like),
                                      [fn(n, None) for n in names])
  restored = codec.decode_state(store, like=like, shardings=tree)
  assert restored.layers[0].v.sharding == NamedSharding(mesh, _kv_spec())
  # Without shardings, a template of sharded arrays keeps its own placement.
  template = jax.tree_util.tree_map(
      lambda x, s: jax.device_put(jnp.zeros(x.shape, x.dtype), s), like, tree)
  restored2 = codec.decode_state(store, like=template)
  assert restored2.layers[1].recurrent.sharding == NamedSharding(mesh, _rec_spec())
  np.testing.assert_array_equal(np.asarray(restored2.layers[0].v[:, :17]),
                                np.asarray(state.layers[0].v[:, :17]))


def test_token_sharded_cache_roundtrips():
  # Sequence-parallel prefill shards the token axis: chunk boundaries must
  # follow shard boundaries there too, and the trim cuts inside one shard.
  mesh = _mesh(4)
  k = jax.random.normal(jax.random.PRNGKey(3), (1, 256, 2, 16), jnp.float32)
  s = NamedSharding(mesh, P(None, "tp", None, None))
  state = DecodeState(layers=(AttentionCache(jax.device_put(k, s), jax.device_put(-k, s)),),
                      lengths=jnp.array([150], jnp.int32))
  store = codec.MemoryStore()
  m = codec.encode_state(state, store, model_id="m", config_fingerprint="f",
                         options=codec.CodecOptions(chunk_bytes=4096))
  chunk_tokens = m.layers[0].array("layers/0/k").chunk_shape[1]
  assert 64 % chunk_tokens == 0
  restored = codec.decode_state(store, like=jax.eval_shape(lambda: state))
  np.testing.assert_array_equal(np.asarray(restored.layers[0].k[:, :150]),
                                np.asarray(k[:, :150]))
  assert not np.asarray(restored.layers[0].k[:, 150:]).any()


def test_multi_process_write_merges_partial_manifests(tmp_path):
  # Two writers, each holding half of the heads, as two hosts of a TP=8 prefill
  # would. Objects of the other half are all zero in each writer's view, and
  # zero chunks are not stored, so each writer emits only its own objects.
  state = make_state(_mesh(8), n_tokens=40)
  heads = np.arange(8)

  def half(x, keep):
    if x.ndim != 4:
      return x
    axis = 2 if x.shape[2] == 8 else 1
    mask = np.isin(heads, keep).reshape([-1 if a == axis else 1 for a in range(4)])
    return jax.device_put(jnp.where(mask, x, 0), x.sharding)

  url = f"file://{tmp_path}/"
  parts = [jax.tree_util.tree_map(lambda x: half(x, heads[:4]), state),
           jax.tree_util.tree_map(lambda x: half(x, heads[4:]), state)]
  like = jax.eval_shape(lambda: state)
  m0 = codec.encode_state(parts[0], url, model_id="m", config_fingerprint="f",
                          process_index=0, process_count=2)
  with pytest.raises(codec.IncompleteStateError, match=r"processes \[1\] \(of 2\)"):
    codec.decode_state(url, like=like)
  m1 = codec.encode_state(parts[1], url, model_id="m", config_fingerprint="f",
                          process_index=1, process_count=2)
  keys0 = {c.key for c in m0.layers[0].array("layers/0/k").chunks}
  keys1 = {c.key for c in m1.layers[0].array("layers/0/k").chunks}
  assert keys0 & keys1 == {"layers/0/k/zarr.json"}
  merged = codec.read_manifest(url)
  assert {c.key for c in merged.layers[0].array("layers/0/k").chunks} == keys0 | keys1
  restored = codec.decode_state(url, like=like)
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
    a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    if a.shape[1:2] == (256,):
      a, b = a[:, :40], b[:, :40]
    np.testing.assert_array_equal(a, b)
