"""gRPC state transfer between a real client and a real server on 127.0.0.1."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paas_jax import codec, transport
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.proto import transport_pb2
from paas_jax.state import abstract_state
from paas_jax.transport import (SenderOptions, StateReceiver, StateSender,
                                TransferError, serve_receiver)
from tests.transport.grpc_rig import (N, begin, chunk_frame, encoded_layers, raw_begin, raw_stub,
                                      wait_for)

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def state(config):
  return random_state(config, [N], capacity=64, seed=1)


def test_layerwise_stream_restores_state_and_overlaps(config, state, make_rx):
  rx = make_rx()
  produced = {}

  def slow_prefill():
    # Each layer takes 0.15 s to "compute"; the transfer must not wait for the end.
    for i, layer in enumerate(state.layers):
      time.sleep(0.15)
      produced[i] = time.time()
      yield i, layer

  options = SenderOptions(num_streams=3, num_connections=2)
  with StateSender(rx.target, options=options) as sender:
    with begin(sender, config, codec=codec.CodecOptions(compression="zstd",
                                                         chunk_bytes=2048)) as tx:
      tx.send_layers(slow_prefill())
      result = tx.finish()
  received = rx.receiver.ready.get(timeout=5)
  assert received.info.transfer_id == result.transfer_id
  assert_states_match(state, received.state, N)
  assert received.state.capacity == 128

  tl = result.timeline
  assert tl.status == "ok" and tl.num_streams == 3 and tl.num_connections == 2
  assert tl.state_bytes == result.manifest.nbytes == tl.bytes_sent
  assert tl.resent_chunks == 0 and tl.end_s >= tl.last_byte_s >= tl.first_byte_s >= tl.start_s
  assert tl.goodput_bytes_per_s == pytest.approx(tl.state_bytes / tl.duration_s)
  first_layer = next(l for l in tl.layers if l.index == 0)
  # Pipelining: layer 0 was on the wire before the last layer existed.
  assert first_layer.first_sent_s < produced[config.n_layers - 1]
  rtl = received.timeline
  assert rtl.bytes_received == tl.state_bytes and rtl.rejected_chunks == 0
  assert rtl.layers_complete_s[0] < produced[config.n_layers - 1]
  assert rx.receiver.timeline(result.transfer_id) == rtl
  rx.assert_clean()


def test_layerwise_prefill_matches_prefill(config, make_rx):
  from paas_jax.models.api import LayerwisePrefill, Model, prefill
  model = Model.create(config, seed=0)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, 40)
  rx = make_rx()
  with StateSender(rx.target) as sender, begin(sender, config, lengths=[40]) as tx:
    run = LayerwisePrefill(model, tokens)
    tx.send_layers(run)
    tx.finish()
  _, reference = prefill(model, tokens)
  assert_states_match(reference, rx.receiver.ready.get(timeout=5).state, 40)
  assert_states_match(reference, run.state, 40)


def test_flow_control_bounds_queued_bytes(make_rx):
  config = load_config("tiny_dense_gqa")
  state = random_state(config, [1000], capacity=1024, seed=2)
  rx = StateReceiver(models={config.name: config.fingerprint()})
  server = serve_receiver(rx)
  try:
    options = SenderOptions(num_streams=2, max_inflight_bytes=48 << 10)
    with StateSender(server.target, options=options) as sender:
      result = sender.send_state(state, model_id=config.name,
                                 config_fingerprint=config.fingerprint(),
                                 codec=codec.CodecOptions(chunk_bytes=16 << 10))
    received = rx.ready.get(timeout=5)
    # No template at this receiver: it hands over the verified objects.
    assert received.state is None and received.store is not None
    restored = received.restore(abstract_state(config, 1, 1024))
    assert_states_match(state, restored, 1000)
    assert result.timeline.peak_queued_bytes <= 48 << 10
    assert result.manifest.nbytes > 20 * (48 << 10)
  finally:
    server.stop(0)


class CorruptChunks(grpc.StreamUnaryClientInterceptor):
  """Flips a byte of chunks whose key matches, on the first ``times`` sends."""

  def __init__(self, match: str, times: int | None):
    self.match, self.times, self.corrupted = match, times, 0
    self.lock = threading.Lock()

  def intercept_stream_unary(self, continuation, details, request_iterator):
    return continuation(details, self._frames(request_iterator))

  def _frames(self, frames):
    for frame in frames:
      if frame.WhichOneof("body") == "chunk" and self.match in frame.chunk.key:
        with self.lock:
          hit = self.times is None or self.corrupted < self.times
          self.corrupted += hit
        if hit:
          bad = transport_pb2.Frame()
          bad.CopyFrom(frame)
          data = bytearray(bad.chunk.data)
          data[len(data) // 2] ^= 0xFF
          bad.chunk.data = bytes(data)
          frame = bad
      yield frame


def intercepted_sender(target, interceptor, **options):
  channel = transport.channels.make_channels(target, 1)[0]
  return StateSender(channels_=[grpc.intercept_channel(channel, interceptor)],
                     options=SenderOptions(**options))


def test_corrupted_frame_is_resent(config, state, make_rx):
  rx = make_rx()
  corrupt = CorruptChunks("layers/3/k/c/", times=1)
  sender = intercepted_sender(rx.target, corrupt)
  with begin(sender, config) as tx:
    for i, layer in enumerate(state.layers):
      tx.send_layer(i, layer)
    result = tx.finish()
  assert corrupt.corrupted == 1
  assert result.timeline.resent_chunks == 1
  assert result.timeline.bytes_sent > result.timeline.state_bytes
  # The link gauges count the resent chunk too, as TransferDone.bytes_sent does.
  g = sender.counters.gauges()
  assert g["link_bytes_sent_total"] == result.timeline.bytes_sent
  assert g["link_bytes_pending"] == 0
  received = rx.receiver.ready.get(timeout=5)
  assert received.timeline.rejected_chunks == 1
  assert_states_match(state, received.state, N)
  rx.assert_clean()


def test_persistent_corruption_fails_with_data_loss(config, state, make_rx):
  rx = make_rx(max_chunk_attempts=3)
  sender = intercepted_sender(rx.target, CorruptChunks("layers/3/v/c/", times=None),
                              max_retry_rounds=5)
  with pytest.raises(TransferError) as info:
    with begin(sender, config) as tx:
      tx.send_layers(enumerate(state.layers))
      tx.finish()
  err = info.value
  assert err.code == grpc.StatusCode.DATA_LOSS
  assert "layer 3" in err.message and "layers/3/v/c/" in err.message
  assert "crc32c mismatch" in err.message
  assert wait_for(lambda: rx.failures)
  tid, code, message = rx.failures[0]
  assert tid == tx.transfer_id and code == grpc.StatusCode.DATA_LOSS
  assert rx.receiver.ready.empty()
  rx.assert_clean()
  assert tx.timeline().status == "DATA_LOSS"


def test_closing_sender_aborts_open_transfers(config, state, make_rx):
  rx = make_rx()
  sender = StateSender(rx.target)
  tx = begin(sender, config)
  tx.send_layer(0, state.layers[0])
  sender.close()
  assert tx.timeline().status == "CANCELLED"
  with pytest.raises(TransferError):
    tx.send_layer(1, state.layers[1])
  assert wait_for(lambda: rx.failures)
  assert rx.failures[0][:2] == (tx.transfer_id, grpc.StatusCode.CANCELLED)
  rx.assert_clean()


def test_hung_sender_is_reaped(config, state, make_rx):
  rx = make_rx(idle_timeout_s=0.5)
  channel, stub = raw_stub(rx.target)
  raw_begin(stub, config, "hung")
  group = encoded_layers(state)[0]
  release = threading.Event()

  def frames():
    key, data = next(iter(group.blobs.items()))
    yield chunk_frame("hung", 0, key, data)
    release.wait(10)

  call = stub.Push.future(frames(), timeout=10)
  assert wait_for(lambda: rx.failures, timeout=5)
  assert rx.failures[0][:2] == ("hung", grpc.StatusCode.DEADLINE_EXCEEDED)
  rx.assert_clean()
  release.set()
  with pytest.raises(grpc.RpcError):
    call.result()
  channel.close()


def test_begin_deadline_against_silent_peer(config):
  # A peer that accepts TCP but never speaks HTTP/2.
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  try:
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    with StateSender(target, options=SenderOptions(rpc_timeout_s=0.5)) as sender:
      t0 = time.monotonic()
      with pytest.raises(TransferError) as info:
        begin(sender, config)
      assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
      assert time.monotonic() - t0 < 5
  finally:
    listener.close()


def test_killed_sender_leaves_receiver_clean(config, make_rx):
  rx = make_rx()
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.Popen(
      [sys.executable, str(REPO / "tests/transport/sender_proc.py"), rx.target, "doomed"],
      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    def mid_transfer():
      tl = rx.receiver.timeline("doomed")
      return tl is not None and tl.chunks_received > 0
    assert wait_for(mid_transfer, timeout=60), proc.stderr.read1().decode() if (
        proc.poll() is not None) else "sender never got going"
    assert rx.receiver.bytes_in_use > 0
    proc.kill()
    proc.wait(10)
    assert wait_for(lambda: rx.failures, timeout=10)
  finally:
    if proc.poll() is None:
      proc.kill()
  tid, code, message = rx.failures[0]
  assert tid == "doomed" and code == grpc.StatusCode.CANCELLED
  assert "StreamEnd" in message
  assert rx.receiver.ready.empty()
  rx.assert_clean()
  assert rx.receiver.failure("doomed")[0] == grpc.StatusCode.CANCELLED


def test_exception_in_prefill_aborts_both_sides(config, state, make_rx):
  rx = make_rx()

  def failing_prefill():
    yield 0, state.layers[0]
    raise RuntimeError("prefill OOM")

  with StateSender(rx.target) as sender:
    with pytest.raises(RuntimeError, match="prefill OOM"):
      with begin(sender, config) as tx:
        tx.send_layers(failing_prefill())
    assert tx.timeline().status == "CANCELLED"
    assert wait_for(lambda: rx.failures)
    assert rx.failures[0][1] == grpc.StatusCode.CANCELLED
    assert "prefill OOM" in rx.failures[0][2]
    rx.assert_clean()
    # The receiver serves the next transfer normally.
    result = sender.send_state(state, model_id=config.name,
                               config_fingerprint=config.fingerprint())
  assert_states_match(state, rx.receiver.ready.get(timeout=5).state, N)
  assert result.timeline.status == "ok"


def test_receiver_without_template_restores_into_tp2(make_rx):
  # A decode process that picks the placement after the state arrived.
  config = load_config("tiny_dense_gqa")
  state = random_state(config, [N], capacity=64, seed=4)
  receiver = StateReceiver(models={config.name: config.fingerprint()})
  server = serve_receiver(receiver)
  try:
    with StateSender(server.target) as sender:
      sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint(),
                        codec=codec.CodecOptions(compression="blosc"))
    received = receiver.ready.get(timeout=5)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def shardings(name, leaf):
      return NamedSharding(mesh, P(None, None, "tp", None) if leaf.ndim == 4 else P())

    restored = received.restore(abstract_state(config, 1, 64), shardings)
    assert received.store is None  # released after restoring
    assert restored.layers[0].k.sharding == NamedSharding(mesh, P(None, None, "tp", None))
    assert_states_match(state, restored, N)
    assert receiver.bytes_in_use == 0
  finally:
    server.stop(0)


def test_secure_credentials_path(config, state):
  # Local (UDS/loopback) credentials exercise the secure server port and
  # secure channel code paths that mTLS certificates will plug into.
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=lambda info: (abstract_state(config, 1, 64), None))
  server = serve_receiver(receiver, credentials=grpc.local_server_credentials(
      grpc.LocalConnectionType.LOCAL_TCP))
  try:
    options = SenderOptions(credentials=grpc.local_channel_credentials(
        grpc.LocalConnectionType.LOCAL_TCP))
    with StateSender(server.target, options=options) as sender:
      sender.send_state(state, model_id=config.name, config_fingerprint=config.fingerprint())
    assert_states_match(state, receiver.ready.get(timeout=5).state, N)
  finally:
    server.stop(0)


class GateFrames(grpc.StreamUnaryClientInterceptor):
  """Holds every Push stream's frames back until ``gate`` is set (a link that
  has not started draining), so the sender's pending bytes can be seen."""

  def __init__(self):
    self.gate = threading.Event()

  def intercept_stream_unary(self, continuation, details, request_iterator):
    return continuation(details, self._frames(request_iterator))

  def _frames(self, frames):
    self.gate.wait(30)
    yield from frames


def test_link_counters_track_pending_and_sent_bytes(config, state, make_rx):
  """``LinkCounters``: encoded layers are pending until gRPC takes them, then
  sent; after Commit nothing is pending and the bytes counted as sent equal
  the timeline's ``bytes_sent`` (what TransferDone reports). Two senders share
  one counters object, as a server's senders of one link do."""
  rx = make_rx()
  counters = transport.LinkCounters("A->B")
  gate = GateFrames()
  channel = transport.channels.make_channels(rx.target, 1)[0]
  sender = StateSender(channels_=[grpc.intercept_channel(channel, gate)],
                       options=SenderOptions(num_streams=2), counters=counters)
  assert counters.gauges()["link_transfers_active"] == 0
  with begin(sender, config, codec=codec.CodecOptions(chunk_bytes=2048)) as tx:
    g = counters.gauges()
    assert g["link_transfers_active"] == 1 and g["link_bytes_pending"] == 0
    assert counters.transfers()[tx.transfer_id] == {"pending": 0, "sent": 0, "encoded": False}
    tx.send_layer(0, state.layers[0])
    assert wait_for(lambda: counters.pending_bytes > 0)
    first = counters.pending_bytes
    for i in range(1, config.n_layers):
      tx.send_layer(i, state.layers[i])
    assert wait_for(lambda: counters.transfers()[tx.transfer_id]["encoded"])
    # Nothing has left yet (the gate holds the streams): all of it is pending.
    row = counters.transfers()[tx.transfer_id]
    assert row["sent"] == 0 and row["pending"] == counters.pending_bytes > first
    assert counters.gauges()["link_bytes_sent_total"] == 0
    gate.gate.set()
    result = tx.finish()
  g = counters.gauges()
  tl = result.timeline
  assert g["link_bytes_pending"] == 0 and g["link_transfers_active"] == 0
  assert g["link_bytes_sent_total"] == tl.bytes_sent == tl.state_bytes > row["pending"]
  assert g["link_bytes_queued_total"] == tl.bytes_sent and g["link_transfers_total"] == 1
  assert counters.transfers() == {}

  # A second sender on the same link adds to the totals; an aborted transfer's
  # unsent bytes stop being pending.
  other = StateSender(rx.target, counters=counters)
  result2 = other.send_state(state, model_id=config.name,
                             config_fingerprint=config.fingerprint())
  assert counters.gauges()["link_bytes_sent_total"] == tl.bytes_sent + result2.timeline.bytes_sent
  gate.gate.clear()
  tx = begin(sender, config)
  tx.send_layer(0, state.layers[0])
  assert wait_for(lambda: counters.pending_bytes > 0)
  tx.abort("test")
  assert counters.pending_bytes == 0 and counters.gauges()["link_transfers_active"] == 0
  gate.gate.set()
  other.close()
  sender.close()
  channel.close()
