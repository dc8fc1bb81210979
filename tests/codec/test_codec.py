"""State codec: roundtrips, trimming, integrity errors, identity checks."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax import codec
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.state import abstract_state, state_bytes

TINY = ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa", "tiny_swa_gqa"]


def encode(state, dest, config, options=codec.CodecOptions()):
  return codec.encode_state(state, dest, model_id=config.name,
                            config_fingerprint=config.fingerprint(), options=options)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("compression", ["raw", "zstd", "blosc"])
def test_roundtrip_file_into_larger_capacity(tmp_path, name, compression):
  config = load_config(name)
  n = 37
  state = random_state(config, [n], capacity=64, seed=1)
  url = f"file://{tmp_path}/state/"
  manifest = encode(state, url, config, codec.CodecOptions(compression=compression))
  like = abstract_state(config, 1, 256)
  restored = codec.decode_state(url, like=like, expected_fingerprint=config.fingerprint(),
                                expected_model_id=config.name)
  assert restored.capacity == 256
  assert_states_match(state, restored, n)
  assert manifest.layer_kinds == tuple(type(c).__name__ for c in state.layers)
  assert manifest.token_count == n


def test_roundtrip_memory_kvstore_and_manifest_json():
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [20], capacity=64, seed=2)
  store = codec.MemoryStore()
  manifest = encode(state, store, config, codec.CodecOptions(compression="zstd", level=3))
  assert codec.StateManifest.from_json(manifest.to_json()) == manifest
  assert codec.read_manifest(store) == manifest
  restored = codec.decode_state(store, like=abstract_state(config, 1, 64))
  assert_states_match(state, restored, 20)
  # The manifest records everything a reader checks before decoding.
  d = json.loads(manifest.to_json())
  assert d["model_id"] == config.name and d["config_fingerprint"] == config.fingerprint()
  k = manifest.layers[3].array("layers/3/k")
  assert (k.dtype, k.shape, k.stored_shape) == ("float32", (1, 64, 2, 16), (1, 20, 2, 16))
  assert all(c.nbytes > 0 and 0 <= c.crc32c < 2**32 for c in k.chunks)
  assert d["codec"]["compression"] == "zstd"


def test_memory_url_is_a_fresh_store_each_time():
  # Pitfall documented in shared/ENVIRONMENT.md: memory:// opened by URL
  # twice is two stores, so the reader must get the same object.
  config = load_config("tiny_gdn_gqa")
  encode(random_state(config, [4], 64), "memory://", config)
  with pytest.raises(codec.IncompleteStateError):
    codec.read_manifest("memory://")


@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_swa_gqa", "tiny_kda_mla"])
def test_raw_bytes_equal_analytic_state_bytes(name):
  config = load_config(name)
  n = 100  # longer than the SWA window, so the ring is stored whole
  small = random_state(config, [n], capacity=128, seed=3)
  big = random_state(config, [n], capacity=1024, seed=3)
  m_small = encode(small, codec.MemoryStore(), config)
  m_big = encode(big, codec.MemoryStore(), config)
  data_bytes = sum(c.nbytes for g in m_small.groups for a in g.arrays for c in a.chunks
                   if not c.key.endswith("zarr.json"))
  assert data_bytes == state_bytes(config, n).total
  assert m_small.logical_nbytes == state_bytes(config, n).total
  # Only live tokens travel: spare capacity costs nothing.
  assert m_big.nbytes == m_small.nbytes


def test_token_chunks_do_not_pad_the_edge_chunk():
  config = load_config("tiny_dense_gqa")
  n = 700
  state = random_state(config, [n], capacity=1024)
  # 2 heads x 16 dims x 4 bytes = 128 bytes per token; 32 KiB chunks -> 256
  # tokens per chunk would pad the last chunk by 68 tokens.
  m = encode(state, codec.MemoryStore(), config, codec.CodecOptions(chunk_bytes=32 << 10))
  k = m.layers[0].array("layers/0/k")
  assert k.chunk_shape[1] * 128 <= 32 << 10
  data = sum(c.nbytes for c in k.chunks if not c.key.endswith("zarr.json"))
  assert data <= 1.01 * n * 128


def test_empty_state_roundtrips():
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [0], capacity=64)
  store = codec.MemoryStore()
  encode(state, store, config)
  restored = codec.decode_state(store, like=abstract_state(config, 1, 64))
  assert_states_match(state, restored, 0)


def test_batch_of_two_trims_to_longest():
  config = load_config("tiny_mamba2_gqa")
  state = random_state(config, [5, 30], capacity=64, seed=4)
  store = codec.MemoryStore()
  m = encode(state, store, config)
  assert m.token_count == 30 and m.batch == 2
  restored = codec.decode_state(store, like=abstract_state(config, 2, 64))
  assert_states_match(state, restored, 30)


def _chunk_file(root: pathlib.Path, manifest, layer: int) -> tuple[str, pathlib.Path]:
  group = manifest.layers[layer]
  array = group.arrays[0]
  key = next(c.key for c in array.chunks if not c.key.endswith("zarr.json"))
  return key, root / key


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
def test_damaged_chunk_is_named_and_nothing_is_returned(tmp_path, fault):
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [40], capacity=64, seed=5)
  manifest = encode(state, f"file://{tmp_path}/", config)
  key, path = _chunk_file(tmp_path, manifest, 3)
  data = path.read_bytes()
  if fault == "flip":
    path.write_bytes(data[:10] + bytes([data[10] ^ 0x40]) + data[11:])
    expected = "crc32c mismatch"
  elif fault == "truncate":
    path.write_bytes(data[:len(data) // 2])
    expected = f"truncated: {len(data) // 2} of {len(data)} bytes"
  else:
    path.unlink()
    expected = "missing"
  with pytest.raises(codec.ChunkIntegrityError) as info:
    codec.decode_state(f"file://{tmp_path}/", like=abstract_state(config, 1, 64))
  err = info.value
  assert (err.layer_index, err.layer_kind, err.key) == (3, "AttentionCache", key)
  assert "layer 3 (AttentionCache)" in str(err) and key in str(err) and expected in str(err)
  with pytest.raises(codec.ChunkIntegrityError):
    codec.verify_state(f"file://{tmp_path}/")


def test_uncommitted_state_is_refused(tmp_path):
  config = load_config("tiny_gdn_gqa")
  encode(random_state(config, [3], 64), f"file://{tmp_path}/", config)
  (tmp_path / codec.MANIFEST_KEY).unlink()
  with pytest.raises(codec.IncompleteStateError, match="never committed"):
    codec.decode_state(f"file://{tmp_path}/", like=abstract_state(config, 1, 64))


def test_rewrite_ignores_objects_of_the_previous_state(tmp_path):
  config = load_config("tiny_gdn_gqa")
  url = f"file://{tmp_path}/"
  encode(random_state(config, [60], 64, seed=6), url, config)
  second = random_state(config, [60], 64, seed=7)
  # All-zero chunks are not stored; a stale chunk of the first state at the
  # same key must not leak into the second.
  second = second.replace(layers=(second.layers[0].replace(
      recurrent=np.zeros_like(second.layers[0].recurrent)),) + second.layers[1:])
  encode(second, url, config)
  restored = codec.decode_state(url, like=abstract_state(config, 1, 64))
  assert_states_match(second, restored, 60)


def test_fingerprint_and_model_mismatch_are_refused():
  config = load_config("tiny_gdn_gqa")
  store = codec.MemoryStore()
  encode(random_state(config, [3], 64), store, config)
  other = config.with_updates(d_ff=256)
  with pytest.raises(codec.FingerprintMismatchError, match=other.fingerprint()):
    codec.decode_state(store, like=abstract_state(config, 1, 64),
                       expected_fingerprint=other.fingerprint())
  with pytest.raises(codec.FingerprintMismatchError):
    codec.decode_state(store, like=abstract_state(config, 1, 64),
                       expected_model_id="dense_100m")


def test_template_mismatches_are_refused():
  config = load_config("tiny_gdn_gqa")
  store = codec.MemoryStore()
  encode(random_state(config, [50], 64), store, config)
  with pytest.raises(codec.LayoutMismatchError, match="do not fit the template's capacity"):
    codec.decode_state(store, like=abstract_state(config, 1, 32))
  with pytest.raises(codec.LayoutMismatchError, match="layers"):
    codec.decode_state(store, like=abstract_state(load_config("tiny_swa_gqa"), 1, 64))
  bf16 = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype),
      abstract_state(config, 1, 64))
  with pytest.raises(codec.LayoutMismatchError, match="template wants bfloat16"):
    codec.decode_state(store, like=bf16)


def test_ring_buffer_needs_the_same_window():
  config = load_config("tiny_swa_gqa")
  store = codec.MemoryStore()
  encode(random_state(config, [3], 64), store, config)
  wider = abstract_state(config.with_updates(
      attention=config.attention.__class__(**{**config.attention.__dict__, "window": 16})), 1, 64)
  with pytest.raises(codec.LayoutMismatchError, match="ring buffer of window 8"):
    codec.decode_state(store, like=wider)


def test_any_pytree_with_numpy_template():
  rng = np.random.default_rng(0)
  tree = {"a": rng.standard_normal((3, 5)).astype(np.float32),
          "b": [np.arange(7, dtype=np.int64), rng.standard_normal((2,)).astype(np.float16)]}
  store = codec.MemoryStore()
  m = codec.encode_state(tree, store, model_id="m", config_fingerprint="f", token_count=0)
  assert {a.name for a in m.state_arrays.arrays} == {"a", "b/0", "b/1"}
  like = jax.tree_util.tree_map(np.zeros_like, tree)
  out = codec.decode_state(store, like=like)
  for x, y in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(out)):
    assert isinstance(y, np.ndarray)
    np.testing.assert_array_equal(x, y)
