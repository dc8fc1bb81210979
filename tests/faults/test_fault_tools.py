"""The fault injectors against real gRPC servers and a real StateReceiver."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paas_jax import codec
from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.models import load_config
from paas_jax.security.faults import ChunkCorrupter, FaultPlan, FlakyLink
from paas_jax.state import abstract_state
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                TransferError, serve_receiver)
from paas_jax.transport.channels import make_channels

N = 40


@pytest.fixture(scope="module")
def config():
  return load_config("tiny_gdn_gqa")


@pytest.fixture
def health_server():
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
  h = health.HealthServicer()
  h.set("", health_pb2.HealthCheckResponse.SERVING)
  health_pb2_grpc.add_HealthServicer_to_server(h, server)
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  yield f"127.0.0.1:{port}"
  server.stop(0)


@pytest.fixture
def receiver(config):
  rx = StateReceiver(models={config.name: config.fingerprint()},
                     template=lambda info: (abstract_state(config, 1, 64), None),
                     options=ReceiverOptions(idle_timeout_s=2.0))
  server = serve_receiver(rx)
  yield rx, server
  server.stop(0)


def check(channel, timeout=2.0):
  return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=timeout)


def eventually(fn, timeout=15.0):
  end = time.monotonic() + timeout
  while True:
    try:
      return fn()
    except grpc.RpcError:
      if time.monotonic() > end:
        raise
      time.sleep(0.1)


def test_cut_refuses_then_the_link_comes_back(health_server):
  link = FlakyLink(health_server).start()
  options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
  try:
    with grpc.insecure_channel(link.address, options=options) as ch:
      assert check(ch).status == 1
      link.down(FlakyLink.CUT)
      with pytest.raises(grpc.RpcError) as e:
        check(ch)
      assert e.value.code() == grpc.StatusCode.UNAVAILABLE
      assert link.resets >= 2
      link.up()
      assert eventually(lambda: check(ch)).status == 1
  finally:
    link.stop()


def test_blackhole_stalls_but_delivers(health_server):
  link = FlakyLink(health_server).start()
  try:
    with grpc.insecure_channel(link.address) as ch:
      assert check(ch).status == 1
      link.outage(1.0, mode=FlakyLink.BLACKHOLE)
      started = time.monotonic()
      assert check(ch, timeout=10).status == 1
      assert time.monotonic() - started >= 0.8
  finally:
    link.stop()


def test_corrupted_chunks_are_detected_and_resent(config, receiver):
  rx, server = receiver
  state = random_state(config, [N], capacity=64, seed=5)
  corrupter = ChunkCorrupter(times=2, skip=3)
  channels = [grpc.intercept_channel(c, corrupter) for c in make_channels(server.target, 1)]
  with StateSender(channels_=channels, options=SenderOptions(num_streams=2)) as sender:
    result = sender.send_state(state, model_id=config.name,
                               config_fingerprint=config.fingerprint(),
                               codec=codec.CodecOptions(chunk_bytes=2048))
  received = rx.ready.get(timeout=10)
  assert corrupter.corrupted == 2
  assert received.timeline.rejected_chunks == 2
  assert result.timeline.resent_chunks == 2
  assert_states_match(state, received.state, N)


def test_persistent_corruption_fails_cleanly_with_data_loss(config, receiver):
  rx, server = receiver
  corrupter = ChunkCorrupter(times=None, match="layers/0/")
  channels = [grpc.intercept_channel(c, corrupter) for c in make_channels(server.target, 1)]
  with StateSender(channels_=channels, options=SenderOptions(num_streams=1)) as sender:
    with pytest.raises(TransferError) as e:
      sender.send_state(random_state(config, [N], capacity=64), model_id=config.name,
                        config_fingerprint=config.fingerprint())
  assert e.value.code == grpc.StatusCode.DATA_LOSS
  assert "layer 0" in e.value.message
  assert rx.active_transfers() == [] and rx.bytes_in_use == 0


def test_link_cut_mid_transfer_fails_fast_and_a_later_transfer_succeeds(config, receiver):
  rx, server = receiver
  link = FlakyLink(server.target).start()
  state = random_state(config, [N], capacity=64, seed=6)
  options = SenderOptions(num_streams=2, rpc_timeout_s=5, commit_timeout_s=5,
                          transfer_timeout_s=20)
  try:
    with StateSender(link.address, options=options) as sender:
      started = time.monotonic()
      with pytest.raises(TransferError) as e:
        with sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                          num_layers=config.n_layers, lengths=[N]) as tx:
          for i, layer in enumerate(state.layers):
            tx.send_layer(i, layer)
            if i == 1:
              time.sleep(0.3)
              link.outage(1.0)
          tx.finish()
      assert time.monotonic() - started < 15
      assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                              grpc.StatusCode.NOT_FOUND)
    # The receiver dropped everything of the broken transfer.
    deadline = time.monotonic() + 5
    while rx.active_transfers() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert rx.active_transfers() == [] and rx.bytes_in_use == 0
    while link.is_down:
      time.sleep(0.05)
    with StateSender(link.address, options=options) as sender:
      for attempt in range(20):  # the sender's channel may still be backing off
        try:
          sender.send_state(state, model_id=config.name,
                            config_fingerprint=config.fingerprint())
          break
        except TransferError as err:
          assert err.code == grpc.StatusCode.UNAVAILABLE and attempt < 19
          time.sleep(0.5)
    assert_states_match(state, rx.ready.get(timeout=10).state, N)
  finally:
    link.stop()


def test_fault_plan_parsing():
  plan = FaultPlan.parse("kill_after_layers=2,corrupt_chunks=3,delay_first_token_s=0.5")
  assert (plan.kill_after_layers, plan.corrupt_chunks, plan.delay_first_token_s) == (2, 3, 0.5)
  assert plan.active and isinstance(plan.interceptors()[0], ChunkCorrupter)
  assert not FaultPlan.parse("").active
  with pytest.raises(ValueError, match="known"):
    FaultPlan.parse("explode=1")
  assert plan.transfer_started() == 1
  plan.on_layer(2, 5)  # not the planned transfer: nothing happens
