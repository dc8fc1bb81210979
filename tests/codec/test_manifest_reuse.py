"""The manifest's shortcuts for a transfer: a sender splices in the layer
descriptors it already serialized, a receiver reuses the descriptors it
already parsed. Both must give exactly the manifest of the plain paths, and
neither may let a differing layer through unparsed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paas_jax import codec
from paas_jax.codec.encode import build_manifest
from paas_jax.codec.manifest import GLOBAL_LAYER_INDEX, StateManifest
from paas_jax.codec.testing import random_state
from paas_jax.models import load_config


@pytest.fixture(scope="module")
def manifest():
  config = load_config("tiny_gdn_gqa")
  groups = list(codec.encode_groups(random_state(config, [5], capacity=16, seed=0)))
  return build_manifest([g.entry for g in groups], model_id=config.name,
                        config_fingerprint=config.fingerprint(), token_count=5, batch=1,
                        options=codec.CodecOptions())


def _serialized(manifest):
  return {g.index: (g, g.to_json()) for g in manifest.groups}


def test_spliced_json_is_the_same_manifest(manifest):
  spliced = manifest.to_json(_serialized(manifest))
  assert json.loads(spliced) == json.loads(manifest.to_json())
  assert StateManifest.from_json(spliced) == manifest
  with_placements = dataclasses.replace(manifest, placements={"source": {"a": 1}})
  spliced = with_placements.to_json(_serialized(with_placements))
  assert StateManifest.from_json(spliced) == with_placements


def test_splicing_takes_only_texts_of_this_manifests_own_entries(manifest):
  serialized = _serialized(manifest)
  # An equal entry that is another object, with a text that is not its JSON:
  # splicing must not trust it (the plain encoding is used instead).
  layer0 = manifest.layers[0]
  serialized[0] = (dataclasses.replace(layer0), '{"not": "layer 0"}')
  assert StateManifest.from_json(manifest.to_json(serialized)) == manifest
  # Negative control: the same text under the manifest's own entry is spliced,
  # so the shortcut really is taken when allowed (and then trusts the text).
  serialized[0] = (layer0, '{"not": "layer 0"}')
  with pytest.raises(KeyError):
    StateManifest.from_json(manifest.to_json(serialized))


def test_known_descriptors_are_reused_only_when_their_json_is_equal(manifest):
  d = json.loads(manifest.to_json())
  sentinel = dataclasses.replace(manifest.layers[1], kind="ReusedEntry")
  # Layer 1's descriptor arrived as exactly this JSON: the entry that came with it is used.
  known = {1: (d["layers"][1], sentinel)}
  assert StateManifest.from_dict(d, known).layers[1] is sentinel
  # The manifest's layer differs from what arrived (a chunk more): parsed afresh,
  # so Commit's comparison sees the difference.
  changed = json.loads(json.dumps(d["layers"][1]))
  changed["arrays"][0]["chunks"].append({"key": "x/c/9", "nbytes": 4, "crc32c": 7})
  parsed = StateManifest.from_dict(d, {1: (changed, sentinel)})
  assert parsed.layers[1] is not sentinel
  assert parsed == manifest
  # The state-level group is matched by its own index.
  known = {GLOBAL_LAYER_INDEX: (d["state_arrays"], sentinel)}
  assert StateManifest.from_dict(d, known).state_arrays is sentinel


def test_manifest_json_stays_ascii_and_round_trips(manifest):
  """Descriptors travel as ASCII (a BUNDLE's table counts bytes as characters):
  a name outside ASCII is escaped, and the text parses back to the same entry.
  Negative control: orjson alone leaves it as UTF-8."""
  import orjson
  from paas_jax.codec import manifest as manifest_lib
  from paas_jax.codec.manifest import LayerEntry
  layer = manifest.layers[0]
  array = dataclasses.replace(layer.arrays[0], name="layers/0/kv-é")
  odd = dataclasses.replace(layer, arrays=(array,) + layer.arrays[1:])
  text = odd.to_json()
  assert text.isascii() and "\\u00e9" in text
  assert LayerEntry.from_json(text) == odd
  assert not orjson.dumps(odd.to_dict(), option=orjson.OPT_SORT_KEYS).decode().isascii()
  assert manifest_lib.loads(manifest_lib.dumps({"b": 1, "a": [2]})) == {"a": [2], "b": 1}
  assert manifest_lib.dumps({"b": 1, "a": 2}) == '{"a":2,"b":1}'


def test_cached_sizes_belong_to_their_own_entry(manifest):
  """``nbytes`` is computed once per (frozen) entry; an entry derived with
  other chunks has its own."""
  layer = manifest.layers[0]
  array = layer.arrays[0]
  assert array.nbytes == sum(c.nbytes for c in array.chunks) > 0
  grown = dataclasses.replace(array, chunks=array.chunks + (
      dataclasses.replace(array.chunks[0], key=array.name + "/c/9"),))
  assert grown.nbytes == array.nbytes + array.chunks[0].nbytes
  bigger = dataclasses.replace(layer, arrays=(grown,) + layer.arrays[1:])
  assert bigger.nbytes == layer.nbytes + array.chunks[0].nbytes
  assert bigger.num_chunks == layer.num_chunks + 1
