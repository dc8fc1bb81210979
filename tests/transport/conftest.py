"""Fixtures the transport tests share: the tiny hybrid model, one random state of it,
and real gRPC StateTransfer receivers (``make_rx``)."""

from __future__ import annotations

import pytest

from paas_jax.codec.testing import random_state
from paas_jax.models import load_config
from paas_jax.state import abstract_state
from paas_jax.transport import ReceiverOptions, StateReceiver, serve_receiver
from tests.transport.dataplane_rig import N
from tests.transport.grpc_rig import Rx


@pytest.fixture(scope="module")
def config():
  """tiny_gdn_gqa: every layer kind the transport has to carry, small enough to move fast."""
  return load_config("tiny_gdn_gqa")


@pytest.fixture(scope="module")
def state(config):
  """A random state of N tokens (a file may override it with its own length or seed)."""
  return random_state(config, [N], capacity=64, seed=3)


@pytest.fixture
def make_rx(config):
  """Starts receivers for the tiny model (``make_rx(template=True, **ReceiverOptions)``)
  and stops them after the test."""
  started = []

  def make(template=True, **options):
    failures = []
    receiver = StateReceiver(
        models={config.name: config.fingerprint()},
        template=(lambda info: (abstract_state(config, 1, 128), None)) if template else None,
        on_failure=lambda *a: failures.append(a),
        options=ReceiverOptions(**options))
    server = serve_receiver(receiver)
    started.append(server)
    return Rx(receiver, server, failures)

  yield make
  for server in started:
    server.stop(0)
