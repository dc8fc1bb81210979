"""Shared rig of the data-plane tests (test_dataplane.py, test_dataplane_control.py):
real StateReceivers behind real gRPC ports with the data plane on, and the
helpers both files send and check with."""

from __future__ import annotations

import collections
import contextlib
import time

import grpc

from paas_jax import codec
from paas_jax.state import abstract_state
from paas_jax.transport import ReceiverOptions, StateReceiver, serve_receiver

N = 50  # tokens of the test state
SMALL_CHUNKS = codec.CodecOptions(chunk_bytes=4096)
# SenderOptions of the per-frame path (DESCRIPTOR + CHUNK frames), which states
# above SenderOptions.bundle_bytes take: the test state (~33 KB) would
# otherwise go as one BUNDLE frame, and these tests are about single frames.
STREAMED = {"bundle_bytes": 0}


class CountRpcs(grpc.ServerInterceptor):
  """Counts the StateTransfer RPCs that reach the receiver's gRPC port."""

  def __init__(self):
    self.calls = collections.Counter()

  def intercept_service(self, continuation, details):
    self.calls[details.method.rsplit("/", 1)[-1]] += 1
    return continuation(details)


@contextlib.contextmanager
def receivers(config):
  """Yields ``make(**kw)``: a started receiver server (``serve_receiver`` keywords;
  ``options``: ReceiverOptions fields) with ``.failures`` (the receiver's
  on_failure calls) and ``.rpcs`` (StateTransfer RPCs by name); all stopped on exit."""
  started = []

  def make(**kw):
    failures, rpcs = [], CountRpcs()
    receiver = StateReceiver(
        models={config.name: config.fingerprint()},
        template=lambda info: (abstract_state(config, 1, 128), None),
        on_failure=lambda *a: failures.append(a),
        options=ReceiverOptions(**kw.pop("options", {})))
    server = serve_receiver(receiver, data_plane=True, interceptors=[rpcs], **kw)
    started.append(server)
    server.failures, server.rpcs = failures, rpcs.calls
    return server

  try:
    yield make
  finally:
    for server in started:
      server.stop(0)


def send(sender, config, state, **kw):
  return sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint(),
                           **kw)


def assert_clean(server, timeout=10.0):
  """Nothing of a failed or finished transfer is left at the receiver."""
  end = time.monotonic() + timeout
  while time.monotonic() < end and server.receiver.active_transfers():
    time.sleep(0.02)
  assert server.receiver.active_transfers() == []
  assert server.receiver.bytes_in_use == 0
