"""The layer-kind registry: every kind has a spec, unknown letters are refused, and
the files that used to branch on letters ask the registry instead."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from paas_jax.models import load_config
from paas_jax.models.config import LAYER_KINDS, LayerKind
from paas_jax.models.kinds import (GROWING_CACHES, PAGED_CACHES, REGISTRY, PrefixRule,
                                   kind_spec)

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Files whose per-kind if-chains the registry replaced.
DISPATCH_FILES = ("paas_jax/models/hybrid.py", "paas_jax/state/cache.py",
                  "paas_jax/state/prefix_cache.py", "paas_jax/serving/engine.py")


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
  """Lines comparing something to a layer-kind letter (``== "A"``, ``in ("A", "M")``)."""
  letters = set(LAYER_KINDS)
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Compare):
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
  src = 'def f(kind):\n  if kind == "A":\n    return 1\n  return kind in ("A", "M")\n'
  assert _letter_branches(src) == [2, 4]


@pytest.mark.parametrize("path", DISPATCH_FILES)
def test_no_letter_branches_left(path):
  assert _letter_branches((ROOT / path).read_text()) == []
