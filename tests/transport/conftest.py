"""Fixtures the transport tests share: the tiny hybrid model and one random state of it."""

from __future__ import annotations

import pytest

from paas_jax.codec.testing import random_state
from paas_jax.models import load_config
from tests.transport.dataplane_rig import N


@pytest.fixture(scope="module")
def config():
  """tiny_gdn_gqa: every layer kind the transport has to carry, small enough to move fast."""
  return load_config("tiny_gdn_gqa")


@pytest.fixture(scope="module")
def state(config):
  """A random state of N tokens (a file may override it with its own length or seed)."""
  return random_state(config, [N], capacity=64, seed=3)
