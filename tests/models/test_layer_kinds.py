"""The layer-kind registry: every kind has a spec, unknown letters are refused, and
the files that used to branch on letters ask the registry instead."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import numpy as np
import pytest

from paas_jax.models import load_config
from paas_jax.models.config import LAYER_KINDS, LayerKind
from paas_jax.models.kinds import (GROWING_CACHES, PAGED_CACHES, REGISTRY, PrefixRule,
                                   StatePositions, kind_spec)

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Files whose per-kind if-chains the registry replaced.
DISPATCH_FILES = ("paas_jax/models/hybrid.py", "paas_jax/state/cache.py",
                  "paas_jax/state/prefix_cache.py", "paas_jax/serving/slot_pool.py",
                  "paas_jax/serving/decode_engine.py", "paas_jax/serving/prefill_engine.py",
                  "paas_jax/checkpoints/hf_layout.py", "paas_jax/checkpoints/hf_qwen3_next.py",
                  "paas_jax/checkpoints/hf_kimi_linear.py", "paas_jax/checkpoints/hf_nemotron_h.py",
                  "paas_jax/state/sensitivity.py")


def test_registry_covers_every_kind():
  assert set(REGISTRY) == set(LayerKind)
  assert LAYER_KINDS == tuple(k.value for k in LayerKind)
  for kind, spec in REGISTRY.items():
    assert spec.kind is kind
    assert kind_spec(kind.value) is spec and kind_spec(kind) is spec
    # A paged (pooled) cache must be one indexed by position.
    assert spec.paged is None or spec.grows
    assert spec.grows == (spec.prefix_rule is PrefixRule.BLOCK_KV)
  assert {s.cache_type for s in REGISTRY.values() if s.grows} == set(GROWING_CACHES)
  assert len(PAGED_CACHES) == sum(s.paged is not None for s in REGISTRY.values())


@pytest.mark.parametrize("letter", ["X", "a", "", "AM"])
def test_unknown_letter_is_refused_clearly(letter):
  with pytest.raises(ValueError, match="unknown layer kind") as e:
    kind_spec(letter)
  assert all(k in str(e.value) for k in LAYER_KINDS)


def test_unknown_letter_in_a_config_is_refused():
  config = load_config("tiny_gdn_gqa")
  with pytest.raises(ValueError, match=r"layer_pattern: unknown layer kind 'X'"):
    config.with_updates(layer_pattern="GX")


@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa",
                                  "tiny_swa_gqa", "tiny_dense_gqa"])
def test_each_kind_shapes_match_its_byte_rule(name):
  # cache_shapes and state_bytes are written independently; hold them equal.
  config = load_config(name)
  for letter in set(config.layer_kinds):
    spec = kind_spec(letter)
    for capacity in (0, 64):
      shapes = spec.cache_shapes(config, 1, capacity)
      nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())
      fixed, per_token = spec.state_bytes(config)
      assert nbytes == fixed + per_token * capacity, (letter, capacity)


def _letter_branches(source: str) -> list[int]:
  """Lines comparing something to a layer-kind letter (``== "A"``, ``in ("A", "M")``,
  ``"A" in kinds``)."""
  letters = set(LAYER_KINDS)
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Compare):
      continue
    if isinstance(node.left, ast.Constant) and node.left.value in letters:
      out.append(node.lineno)
      continue
    for op, right in zip(node.ops, node.comparators):
      consts = []
      if isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(right, ast.Constant):
        consts = [right.value]
      elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.Set,
                                                                       ast.List)):
        consts = [e.value for e in right.elts if isinstance(e, ast.Constant)]
      if any(c in letters for c in consts):
        out.append(node.lineno)
  return out


def test_branch_detector_fires():
  # Negative control: the old dispatch style is caught.
  src = ('def f(kind, kinds):\n  if kind == "A":\n    return 1\n  if "m" in kinds:\n'
         '    return 2\n  return kind in ("A", "M")\n')
  assert _letter_branches(src) == [2, 4, 6]


@pytest.mark.parametrize("path", DISPATCH_FILES)
def test_no_letter_branches_left(path):
  assert _letter_branches((ROOT / path).read_text()) == []


def test_state_positions_agree_with_the_prefix_rule():
  """LINEAR caches are the block-KV ones; only SUMMARY kinds name summary
  fields, and those are fields of their cache."""
  for kind, spec in REGISTRY.items():
    assert (spec.positions is StatePositions.LINEAR) == (spec.prefix_rule is PrefixRule.BLOCK_KV)
    fields = {f.name for f in dataclasses.fields(spec.cache_type)}
    assert set(spec.summary_fields) <= fields, kind
    assert bool(spec.summary_fields) == (spec.positions is StatePositions.SUMMARY), kind


def test_sensitivity_corruptions_follow_the_registry():
  from paas_jax.state import sensitivity
  for kind, spec in REGISTRY.items():
    has_blocks = spec.positions is not StatePositions.SUMMARY
    assert ("drop_last_block" in sensitivity.APPLIES[kind.value]) == has_blocks


def test_hf_family_refuses_a_kind_it_has_no_layout_for():
  """Each family's mixer tensors are a table keyed by LayerKind; a kind missing
  from it is an HFImportError naming the kind, not a wrong mapping."""
  from paas_jax.checkpoints.hf_families import FAMILIES, HFImportError
  mapped = {name: set(f.MIXER_SPECS) for name, f in FAMILIES.items()}
  assert mapped == {"qwen3_next": {LayerKind.GATED_DELTA, LayerKind.ATTENTION},
                    "kimi_linear": {LayerKind.GATED_DELTA, LayerKind.MLA},
                    "nemotron_h": {LayerKind.MAMBA2, LayerKind.ATTENTION}}
  for family in FAMILIES.values():
    assert set(family.LAYER_TYPES.values()) == set(family.MIXER_SPECS)
    with pytest.raises(HFImportError, match="no weight layout for layer kind SLIDING"):
      family.mixer_specs("S", {}, None, {}, "model.layers.0", ("blocks", 0, "mixer"))
