"""Raw chunks built and read without TensorStore match TensorStore exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paas_jax import codec
from paas_jax.codec import chunks as chunks_lib
from paas_jax.codec import decode as decode_lib
from paas_jax.codec.layout import ArrayRole
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.state import AttentionCache, DecodeState, abstract_state

TINY = ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa", "tiny_swa_gqa", "tiny_dense_gqa"]


@pytest.fixture
def tensorstore_encode(monkeypatch):
  """Forces every array through TensorStore, as the codec did before the fast path."""
  def force():
    monkeypatch.setattr(chunks_lib, "encode_raw_chunks", lambda *a, **k: None)
  return force


def _encode_all(state, options, token_count=None):
  return list(codec.encode_groups(state, options=options, token_count=token_count))


def _assert_same_groups(fast, reference):
  assert len(fast) == len(reference)
  for f, r in zip(fast, reference):
    assert f.entry == r.entry
    assert f.entry.to_json() == r.entry.to_json()
    assert list(f.blobs) == sorted(r.blobs)
    assert {k: bytes(v) for k, v in f.blobs.items()} == {k: bytes(v) for k, v in r.blobs.items()}


def _special_values_state(config, n, capacity):
  """Random state with all-zero chunks, negative zeros and an all-zero layer."""
  state = random_state(config, [n], capacity=capacity, seed=11)
  layers = list(state.layers)
  first = layers[0]
  leaves, treedef = jax.tree_util.tree_flatten(first)
  changed = []
  for i, leaf in enumerate(leaves):
    leaf = np.array(leaf)
    if i == 0:
      leaf[...] = 0  # Every chunk equals the fill value: nothing but zarr.json stored.
    elif leaf.ndim >= 2:
      leaf[:, : leaf.shape[1] // 2] = -0.0  # Not the fill value: must be stored.
    changed.append(leaf)
  layers[0] = jax.tree_util.tree_unflatten(treedef, changed)
  if len(layers) > 1:
    # Zero a few token rows so that some (not all) chunks are all fill value.
    leaves, treedef = jax.tree_util.tree_flatten(layers[1])
    zeroed = []
    for leaf in leaves:
      leaf = np.array(leaf)
      if leaf.ndim == 4:
        leaf[:, : min(20, leaf.shape[1])] = 0
      zeroed.append(leaf)
    layers[1] = jax.tree_util.tree_unflatten(treedef, zeroed)
  return state.replace(layers=tuple(layers))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1536])
def test_raw_objects_equal_tensorstore_objects(name, quantization, chunk_bytes):
  config = load_config(name)
  options = codec.CodecOptions(quantization=quantization, chunk_bytes=chunk_bytes)
  for n in (0, 1, 37):
    state = _special_values_state(config, n, capacity=64)
    fast = _encode_all(state, options)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(chunks_lib, "encode_raw_chunks", lambda *a, **k: None)
      reference = _encode_all(state, options)
    _assert_same_groups(fast, reference)


def test_special_values_state_has_skipped_and_negative_zero_chunks():
  config = load_config("tiny_dense_gqa")
  state = _special_values_state(config, 37, capacity=64)
  groups = _encode_all(state, codec.CodecOptions(chunk_bytes=1536))
  first = groups[0].entry.arrays
  # The all-zero array stores only its zarr.json; the -0.0 half is stored.
  assert [c.key for c in first[0].chunks] == [first[0].metadata_key]
  assert len(first[1].chunks) > 1
  second = groups[1].entry.arrays[0]
  n_cells = -(-second.stored_shape[1] // second.chunk_shape[1]) * (
      second.stored_shape[2] // second.chunk_shape[2])
  assert 1 < len(second.chunks) - 1 < n_cells


def test_rank0_and_odd_dtypes_match_tensorstore():
  rng = np.random.default_rng(0)
  tree = {"scalar": np.int32(7), "zero_scalar": np.float32(0),
          "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
          "f8": rng.standard_normal((4, 3)).astype(ml_dtypes.float8_e4m3fn),
          "i8": rng.integers(-5, 5, (2, 9)).astype(np.int8),
          "f16": rng.standard_normal((6,)).astype(np.float16),
          "bool": rng.integers(0, 2, (5, 2)).astype(bool),
          "empty": np.zeros((2, 0, 3), np.float32),
          "big_endian": rng.standard_normal((3, 4)).astype(">f4")}
  named = [(k, v) for k, v in tree.items()]
  options = codec.CodecOptions(chunk_bytes=1024)
  fast = codec.encode_state_arrays(named, options=options)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chunks_lib, "encode_raw_chunks", lambda *a, **k: None)
    reference = codec.encode_state_arrays(named, options=options)
  _assert_same_groups([fast], [reference])
  assert "scalar/c" in fast.blobs and "zero_scalar/c" not in fast.blobs


def _read_with_tensorstore(blobs: dict, name: str) -> np.ndarray:
  store = codec.MemoryStore()
  store.put_many(blobs)
  arr = ts.open(store.zarr_spec(name), context=store.context, open=True, read=True).result()
  return arr.read().result()


@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_swa_gqa"])
def test_tensorstore_reads_raw_objects(name):
  config = load_config(name)
  n = 37
  state = _special_values_state(config, n, capacity=64)
  for group in _encode_all(state, codec.CodecOptions(chunk_bytes=1536)):
    leaves = dict(codec.layout.named_leaves(state))
    for entry in group.entry.arrays:
      got = _read_with_tensorstore(group.blobs, entry.name)
      want = np.asarray(leaves[entry.name])
      if entry.token_axis is not None:
        want = np.take(want, np.arange(entry.stored_shape[entry.token_axis]),
                       axis=entry.token_axis)
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_raw_reader_equals_tensorstore_reader(name, quantization, tensorstore_encode,
                                              monkeypatch):
  config = load_config(name)
  n = 37
  state = _special_values_state(config, n, capacity=64)
  options = codec.CodecOptions(quantization=quantization, chunk_bytes=1536)
  store = codec.MemoryStore()
  codec.encode_state(state, store, model_id="m", config_fingerprint="f", options=options)
  like = abstract_state(config, 1, 128)
  fast = codec.decode_state(store, like=like)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chunks_lib, "raw_layout", lambda *a, **k: None)
    reference = codec.decode_state(store, like=like)
  for a, b in zip(jax.tree_util.tree_leaves(fast), jax.tree_util.tree_leaves(reference)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  if quantization == "none":
    assert_states_match(state, fast, n)
  # Objects written by TensorStore itself read the same through the raw reader.
  tensorstore_encode()
  store2 = codec.MemoryStore()
  codec.encode_state(state, store2, model_id="m", config_fingerprint="f", options=options)
  again = codec.decode_state(store2, like=like)
  for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_decode_uses_the_raw_reader_and_never_opens_tensorstore(monkeypatch):
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [20], capacity=64)
  store = codec.MemoryStore()
  codec.encode_state(state, store, model_id="m", config_fingerprint="f")

  def no_open(*a, **k):
    raise AssertionError("raw arrays must not be opened through TensorStore")

  monkeypatch.setattr(decode_lib.ts, "open", no_open)
  restored = codec.decode_state(store, like=abstract_state(config, 1, 64))
  assert_states_match(state, restored, 20)


def test_compressed_arrays_still_go_through_tensorstore():
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [20], capacity=64)
  group = codec.encode_layer(3, state.layers[3], token_count=20,
                             options=codec.CodecOptions(compression="zstd"))
  k = group.entry.array("layers/3/k")
  data = [c for c in k.chunks if not c.key.endswith("zarr.json")]
  assert data and all(c.nbytes != 20 * 2 * 16 * 4 for c in data)
  assert chunks_lib.raw_layout(group.blobs[k.metadata_key], k.stored_shape,
                               k.stored_dtype) is None


def test_wrong_sized_raw_chunk_is_rejected_by_tensorstore():
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [20], capacity=64)
  group = codec.encode_layer(3, state.layers[3], token_count=20,
                             options=codec.CodecOptions())
  entry = group.entry.array("layers/3/k")
  key = next(c.key for c in entry.chunks if not c.key.endswith("zarr.json"))
  blobs = dict(group.blobs)
  blobs[key] = blobs[key][:-4]
  store = codec.MemoryStore()
  store.put_many(blobs)
  with pytest.raises(ValueError):
    codec.restore_array(store, group.entry, entry, entry.shape, np.dtype(entry.dtype), None,
                        as_numpy=True)


def test_unrecognised_metadata_is_not_read_raw():
  meta = chunks_lib.metadata_json((2, 3), np.dtype(np.float32), (1, 3),
                                  codec.CodecOptions().zarr_codecs(4), ["batch", None])
  assert chunks_lib.raw_layout(meta, (2, 3), "float32") == (np.dtype(np.float32), (1, 3))
  assert chunks_lib.raw_layout(meta, (2, 4), "float32") is None
  assert chunks_lib.raw_layout(meta, (2, 3), "int32") is None
  assert chunks_lib.raw_layout(meta.replace(b'"fill_value":0.0', b'"fill_value":1.0'),
                               (2, 3), "float32") is None
  assert chunks_lib.raw_layout(meta.replace(b'"fill_value":0.0', b'"fill_value":-0.0'),
                               (2, 3), "float32") is None
  assert chunks_lib.raw_layout(meta.replace(b'"little"', b'"big"'), (2, 3), "float32") is None
  assert chunks_lib.raw_layout(b"not json", (2, 3), "float32") is None
  assert chunks_lib.raw_layout(None, (2, 3), "float32") is None


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("tp",))


@pytest.mark.parametrize("spec", [P(None, "tp", None, None), P(None, None, "tp", None)])
def test_sharded_raw_objects_equal_tensorstore_objects(spec):
  mesh = _mesh(4)
  k = jax.random.normal(jax.random.PRNGKey(3), (1, 256, 4, 16), jnp.bfloat16)
  s = NamedSharding(mesh, spec)
  state = DecodeState(layers=(AttentionCache(jax.device_put(k, s), jax.device_put(-k, s)),),
                      lengths=jnp.array([150], jnp.int32))
  options = codec.CodecOptions(chunk_bytes=1024)
  fast = _encode_all(state, options)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chunks_lib, "encode_raw_chunks", lambda *a, **k: None)
    reference = _encode_all(state, options)
  _assert_same_groups(fast, reference)


def test_chunk_crossing_shards_falls_back_to_tensorstore():
  x = np.arange(24, dtype=np.float32).reshape(2, 12)
  shards = [([(0, 2), (0, 6)], x[:, :6]), ([(0, 2), (6, 12)], x[:, 6:])]
  # Chunks of 4 columns straddle the shard boundary at 6.
  assert chunks_lib.encode_raw_chunks("a", shards, (2, 12), (1, 4), x.dtype) is None
  got = chunks_lib.encode_raw_chunks("a", shards, (2, 12), (1, 3), x.dtype)
  assert set(got) == {f"a/c/{i}/{j}" for i in range(2) for j in range(4)}
  assert got["a/c/1/2"][0] == x[1, 6:9].tobytes()
  assert got["a/c/1/2"][1] == codec.crc32c(x[1, 6:9].tobytes())


def test_memory_store_moves_into_tensorstore_once():
  store = codec.MemoryStore()
  store.put_many({"a/x": b"1", "b": b"22"})
  assert not store.in_tensorstore and store.nbytes == 3
  assert store.get("a/x") == b"1" and store.get("nope") is None
  assert store.read_all() == {"a/x": b"1", "b": b"22"}
  kv = store.kvstore  # Moves everything into the TensorStore memory kvstore.
  assert store.in_tensorstore
  assert kv.read("b").result().value == b"22"
  store.put_many({"c": b"333"})
  assert kv.read("c").result().value == b"333"
  kv.write("d", b"4").result()
  assert store.get("d") == b"4" and store.get("a/x") == b"1" and store.get("nope") is None
  assert store.read_all() == {"a/x": b"1", "b": b"22", "c": b"333", "d": b"4"}
  assert store.nbytes == 6
  store.close()
  assert store.kvstore is None and store.context is None and store.nbytes == 0


def test_crc32c_of_buffers_without_copy():
  x = np.arange(1000, dtype=np.float32)
  assert codec.crc32c(memoryview(x).cast("B")) == codec.crc32c(x.tobytes())
  assert codec.crc32c(x) == codec.crc32c(x.tobytes())
  from paas_jax.codec.store import zeros_crc32c
  assert zeros_crc32c(4096) == codec.crc32c(bytes(4096))


def test_metadata_json_is_tensorstores_and_cached():
  codecs = codec.CodecOptions().zarr_codecs(2)
  a = chunks_lib.metadata_json((1, 5, 2), np.dtype(ml_dtypes.bfloat16), (1, 5, 2), codecs,
                               ["batch", "tokens", None])
  b = chunks_lib.metadata_json((1, 5, 2), np.dtype(ml_dtypes.bfloat16), (1, 5, 2), codecs,
                               ["batch", "tokens", None])
  assert a is b
  store = codec.MemoryStore()
  spec = store.zarr_spec("x")
  spec.update({"metadata": {"shape": [1, 5, 2], "data_type": "bfloat16",
                            "chunk_grid": {"name": "regular",
                                           "configuration": {"chunk_shape": [1, 5, 2]}},
                            "codecs": codecs, "dimension_names": ["batch", "tokens", None]},
               "create": True})
  ts.open(spec, context=store.context).result()
  assert store.get("x/zarr.json") == a


def test_role_names_in_metadata():
  # dimension names come from the role, as before
  group = codec.encode_arrays(0, "AttentionCache",
                              [("layers/0/k", np.ones((1, 4, 2, 3), np.float32),
                                ArrayRole(1, 2, "prefix", True, True))],
                              token_count=3, options=codec.CodecOptions())
  assert b'"dimension_names":["batch","tokens","heads",null]' in group.blobs[
      "layers/0/k/zarr.json"]
