"""The probe step is compiled at server start, so a probe costs one decode
step: after ``logit_probe.warm(model, max_ctx)`` a probe at any context below
``max_ctx`` adds no compiled program (control: a context past the warmed range
does)."""

import jax.numpy as jnp

from paas_jax.models import api, load_config
from paas_jax.state import init_state, logit_probe


def _probe_at(model, length):
  cap = logit_probe.probe_capacity(length)
  state = init_state(model.config, 1, cap).replace(lengths=jnp.full((1,), length, jnp.int32))
  logit_probe.probe_logits(model, state, 3)


def test_warm_compiles_every_reachable_capacity():
  model = api.Model.create(load_config("tiny_gdn_gqa"), seed=0)
  max_ctx = 300
  assert logit_probe.warm(model, max_ctx) == 4  # capacities 64, 128, 256, 512
  compiled = api._step_core._cache_size()  # pylint: disable=protected-access
  for length in (1, 5, 63, 64, 100, 200, 255, 299):
    _probe_at(model, length)
  assert api._step_core._cache_size() == compiled  # pylint: disable=protected-access
  _probe_at(model, 700)  # past max_ctx: the negative control compiles
  assert api._step_core._cache_size() == compiled + 1  # pylint: disable=protected-access
