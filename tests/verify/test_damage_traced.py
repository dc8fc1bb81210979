"""``sensitivity.damage_traced`` (the decode slice's fault injection, jitted
over a sharded state) damages exactly as the host ``damage`` does, for every
layer kind: recurrent states zeroed, the last KV block of attention layers
(linear and ring) dropped. The control: the undamaged state differs from
both, so the comparison is not of two unchanged states."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from paas_jax.models import api, load_config
from paas_jax.state import sensitivity
from tests import verify


@pytest.mark.parametrize("name", verify.FAST_CONFIGS)
def test_traced_damage_equals_host_damage(name):
  kinds = tuple(load_config(name).layer_kinds)
  prompt = np.asarray(verify.prompts(name, 1, seed=3)[0], np.int32)
  _, state = api.prefill(verify.model(name), prompt)
  host = sensitivity.damage(state, kinds)
  traced = jax.jit(functools.partial(sensitivity.damage_traced, kinds=kinds,
                                     length=len(prompt)))(state)
  leaves = jax.tree_util.tree_leaves
  for want, got in zip(leaves(host), leaves(traced), strict=True):
    np.testing.assert_array_equal(np.asarray(got), want)
  changed = [not np.array_equal(np.asarray(a), b)
             for a, b in zip(leaves(state), leaves(traced))]
  assert sum(changed) >= len(kinds), changed  # every layer lost something
