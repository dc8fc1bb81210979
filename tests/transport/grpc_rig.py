"""Helpers for the gRPC StateTransfer tests against a real receiver on 127.0.0.1:
``Rx`` (what the ``make_rx`` fixture in conftest.py starts), ``begin`` (a transfer
of an N-token state), and raw Begin/Push frames for tests that speak the protocol
by hand."""

from __future__ import annotations

import dataclasses
import time

import grpc

from paas_jax import codec, transport
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport import StateReceiver
from tests.transport.dataplane_rig import N


@dataclasses.dataclass
class Rx:
  receiver: StateReceiver
  server: transport.ReceiverServer
  failures: list

  @property
  def target(self):
    return self.server.target

  def assert_clean(self):
    """Nothing of a failed or finished transfer is left at the receiver."""
    assert self.receiver.active_transfers() == []
    assert self.receiver.bytes_in_use == 0


def begin(sender, config, **kw):
  kw.setdefault("lengths", [N])
  return sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                      num_layers=config.n_layers, **kw)


def wait_for(predicate, timeout=10.0):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if predicate():
      return True
    time.sleep(0.02)
  return False


def raw_stub(target):
  channel = grpc.insecure_channel(target)
  return channel, transport_pb2_grpc.StateTransferStub(channel)


def raw_begin(stub, config, tid, **kw):
  return stub.Begin(transport_pb2.BeginRequest(
      transfer_id=tid, model_id=config.name, config_fingerprint=config.fingerprint(),
      num_layers=config.n_layers, token_count=N, **kw), timeout=5)


def encoded_layers(state):
  return [codec.encode_layer(i, layer, token_count=N) for i, layer in enumerate(state.layers)]


def chunk_frame(tid, layer, key, data, crc=None, nbytes=None):
  return transport_pb2.Frame(chunk=transport_pb2.Chunk(
      transfer_id=tid, layer_index=layer, key=key, data=data,
      crc32c=codec.crc32c(data) if crc is None else crc,
      nbytes=len(data) if nbytes is None else nbytes))


def with_end(frames):
  return frames + [transport_pb2.Frame(end=transport_pb2.StreamEnd(frames=len(frames)))]
