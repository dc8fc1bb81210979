"""The receiver's idle timeout runs per sender, not per transfer.

Regression (#15, bench_pipeline at 8K tokens with the prefix cache on): on a
slow link, segment 1 of a chunk-streamed prompt was begun while segment 0 (the
25 MB cached prefix) still filled the connection; its first frame waited behind
those bytes for longer than ``idle_timeout_s`` (30 s) and the receiver failed it
with "no frame for 30 s (sender hung or gone)" although the sender was sending
all along. Here the same at small size: a real StateSender through the netem
relay (4 MB/s) into a real receiver with a 1 s idle timeout, transfer B begun
while transfer A's 16 MB cross.
"""

from __future__ import annotations

import time

import grpc
import pytest

from paas_jax.codec.testing import random_state
from paas_jax.netem.link import Link, LinkSpec
from paas_jax.netem.relay import Relay, Route
from paas_jax.proto import transport_pb2, transport_pb2_grpc
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                TransferError, serve_receiver)

RATE = 4e6          # bytes/s on the emulated link
BIG_TOKENS = 65536  # ~16.8 MB of tiny_gdn_gqa state: longer on the link than the buffers
IDLE_S = 1.0


@pytest.fixture
def link(config):
  failures = []
  receiver = StateReceiver(models={config.name: config.fingerprint()}, template=None,
                           on_failure=lambda *a: failures.append(a),
                           options=ReceiverOptions(idle_timeout_s=IDLE_S))
  server = serve_receiver(receiver)
  relay = Relay(LinkSpec(bandwidth_bps=RATE * 8, rtt_s=0.01),
                [Route("t", "127.0.0.1:0", server.target, Link.A_TO_B)]).start()
  yield relay.address("t"), receiver, failures
  relay.stop()
  server.stop(0)


def _begin(sender, config, tid, n):
  return sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                      num_layers=config.n_layers, lengths=[n], transfer_id=tid)


def _two_transfers(address, config, *, per_transfer_clock: bool, b_waits_for_a: bool = False):
  """A (big) then B (small, begun while A's bytes queue); B's outcome.

  ``b_waits_for_a``: B is begun before any of A's bytes and sends nothing until
  A is committed, so B certainly gets no frame of its own for as long as A's
  16 MB take on the link (~4 s, several idle timeouts), whatever the machine's
  load. Without it, how long B's first frame waits depends on how A's bytes sit
  in the sender's, the relay's and the kernel's buffers when B begins.
  """
  big = random_state(config, [BIG_TOKENS], capacity=BIG_TOKENS, seed=1)
  small = random_state(config, [16], capacity=16, seed=2)
  with StateSender(address, options=SenderOptions(num_streams=2, rpc_timeout_s=60)) as s:
    if per_transfer_clock:
      s.sender_id = ""  # what every sender sent before the fix
    a = _begin(s, config, "A", BIG_TOKENS)
    if b_waits_for_a:
      b = _begin(s, config, "B", 16)
    for i, layer in enumerate(big.layers):
      a.send_layer(i, layer)
    if b_waits_for_a:
      a.finish()
    else:
      b = _begin(s, config, "B", 16)  # Begin itself waits behind A's queued bytes
    try:
      for i, layer in enumerate(small.layers):
        b.send_layer(i, layer)
      if not b_waits_for_a:
        a.finish()
      return b.finish()
    except TransferError as e:
      return e


def test_transfer_queued_behind_another_is_not_idle(link, config):
  address, receiver, failures = link
  t0 = time.monotonic()
  out = _two_transfers(address, config, per_transfer_clock=False)
  assert not isinstance(out, TransferError), out
  assert failures == []
  # The link really was slow enough to matter: longer than the idle timeout
  # several times over.
  assert time.monotonic() - t0 > 3 * IDLE_S
  assert receiver.active_transfers() == []


def test_transfer_waiting_for_its_senders_other_transfer_is_not_idle(link, config):
  # The scenario the negative control below uses, with the sender's id.
  address, receiver, failures = link
  out = _two_transfers(address, config, per_transfer_clock=False, b_waits_for_a=True)
  assert not isinstance(out, TransferError), out
  assert failures == []
  assert receiver.active_transfers() == []


def test_negative_control_per_transfer_clock_fails_the_queued_transfer(link, config):
  # Without the sender's id (the receiver's old per-transfer clock), the same
  # scenario fails B although its sender never stopped sending.
  address, _, failures = link
  out = _two_transfers(address, config, per_transfer_clock=True, b_waits_for_a=True)
  assert isinstance(out, TransferError) and out.code == grpc.StatusCode.DEADLINE_EXCEEDED, out
  assert [f[0] for f in failures] == ["B"]


def test_hung_sender_is_still_reaped(link, config):
  # A sender that stops sending altogether: every transfer of it is reaped
  # after the idle timeout, the sender's clock does not keep them alive.
  address, receiver, failures = link
  channel = grpc.insecure_channel(address)
  stub = transport_pb2_grpc.StateTransferStub(channel)
  for tid in ("h1", "h2"):
    stub.Begin(transport_pb2.BeginRequest(
        transfer_id=tid, model_id=config.name, config_fingerprint=config.fingerprint(),
        num_layers=config.n_layers, token_count=8, sender_id="hung-sender"), timeout=10)
  deadline = time.monotonic() + 10 * IDLE_S
  while len(failures) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert sorted(f[0] for f in failures) == ["h1", "h2"]
  assert all(f[1] == grpc.StatusCode.DEADLINE_EXCEEDED for f in failures)
  assert receiver.active_transfers() == []
  channel.close()
