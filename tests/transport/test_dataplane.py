"""The TCP data plane (paas_jax.transport.dataplane) with real sockets, a real
StateReceiver behind a real gRPC port, and real mTLS certificates."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from paas_jax.codec.testing import assert_states_match, random_state
from paas_jax.security import ca as ca_lib
from paas_jax.security.tls import TLSConfig
from paas_jax.state import abstract_state
from paas_jax.transport import (SenderOptions, StateReceiver, StateSender, TransferError,
                                serve_receiver)
from paas_jax.transport.dataplane import frames, tls as dp_tls
from paas_jax.transport.dataplane.tuning import Tuning
from tests.transport.dataplane_rig import (N, SMALL_CHUNKS, STREAMED, assert_clean, receivers,
                                          send)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
  good = tmp_path_factory.mktemp("pki")
  rogue = tmp_path_factory.mktemp("rogue")
  files = ca_lib.make_certs(good, ("prefill-0", "decode-0", "broker-0"))
  rogue_files = ca_lib.make_certs(rogue, ("prefill-0",))
  return files, rogue_files


@pytest.fixture
def make_rx(config):
  with receivers(config) as make:
    yield make


def test_round_trip_token_exact_and_connections_reused(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=3)) as sender:
    for _ in range(3):
      result = send(sender, config, state, codec=SMALL_CHUNKS)
      received = rx.receiver.ready.get(timeout=10)
      assert_states_match(state, received.state, N)
      tl = result.timeline
      assert tl.status == "ok" and tl.num_connections == 3
      assert tl.bytes_sent == tl.state_bytes == result.manifest.nbytes
      assert tl.resent_chunks == 0
    # Long-lived connections: three transfers, three connections in all.
    assert rx.data_plane.connections_total == 3
    lanes = [l for p in sender.data_planes for l in p.lanes()]
    # Striped: whichever lane is free takes the next frame. Which lanes those
    # are is up to the scheduler: a CI run beside other load had one lane carry
    # all three transfers (each small state is one BUNDLE frame), so only the
    # three lanes and the frames they carried are checked here.
    assert len(lanes) == 3 and sum(l.frames_sent for l in lanes) >= 3
  assert_clean(rx)


def test_tls_round_trip_and_wrong_peers_refused(config, state, make_rx, pki):
  files, rogue = pki
  decode, prefill, broker = (TLSConfig.from_files(files[n])
                             for n in ("decode-0", "prefill-0", "broker-0"))
  rx = make_rx(credentials=decode.server(), data_ssl=dp_tls.server_context(decode),
               data_peers=["prefill*"])

  def options(tls):
    return SenderOptions(plane="tcp", lanes=2, credentials=prefill.client(),
                         data_ssl=dp_tls.client_context(tls), rpc_timeout_s=30,
                         tuning=Tuning(connect_timeout_s=3))

  with StateSender(rx.target, options=options(prefill)) as sender:
    send(sender, config, state)
  assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  # A certificate from our CA naming the wrong role: PERMISSION_DENIED.
  with StateSender(rx.target, options=options(broker)) as sender:
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
  assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "broker-0" in e.value.message
  # A certificate from another CA: the handshake fails, UNAVAILABLE.
  with StateSender(rx.target, options=options(TLSConfig.from_files(rogue["prefill-0"]))) as s:
    with pytest.raises(TransferError) as e:
      send(s, config, state)
  assert e.value.code == grpc.StatusCode.UNAVAILABLE
  assert rx.receiver.ready.empty()
  assert_clean(rx)
  with pytest.raises(ValueError, match="data_ssl"):
    SenderOptions(plane="tcp", credentials=prefill.client())


def test_killed_connection_frames_resent_on_the_others(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=3, **STREAMED)) as sender:
    killed = []
    seen = []

    def kill_one(lane, item, payload):
      # The hook sees each frame as it is written (small frames leave in
      # batches, so count frames here rather than lane.frames_sent).
      seen.append(lane.index)
      if item.is_chunk and not killed and seen.count(lane.index) >= 3:
        killed.append(lane.index)
        lane.sock.shutdown(socket.SHUT_RDWR)  # dies mid-transfer, frames outstanding
      return payload

    send(sender, config, state, codec=SMALL_CHUNKS)  # connect the lanes
    rx.receiver.ready.get(timeout=10)
    for pool in sender.data_planes:
      for lane in pool.lanes():
        lane._fault_hook = kill_one
    result = send(sender, config, state, codec=SMALL_CHUNKS)
    assert killed and result.timeline.resent_chunks >= 1
    assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)

    # Negative control: every connection keeps dying -> the transfer fails
    # with UNAVAILABLE, and no partial state is ever handed over.
    def kill_all(lane, item, payload):
      lane.sock.shutdown(socket.SHUT_RDWR)
      return payload

    for pool in sender.data_planes:
      pool.fault_hook = kill_all
      for lane in pool.lanes():
        lane._fault_hook = kill_all
    with pytest.raises(TransferError) as e:
      send(sender, config, state, codec=SMALL_CHUNKS)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def test_corrupted_frame_named_and_resent(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2, **STREAMED)) as sender:
    corrupted = []

    def corrupt_once(lane, item, payload):
      if item.is_chunk and item.layer == 1 and not corrupted:
        corrupted.append(item.key)
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return memoryview(bad)
      return payload

    sender.data_planes  # pools are created on the first Begin
    result = None
    send(sender, config, state, codec=SMALL_CHUNKS)
    rx.receiver.ready.get(timeout=10)
    for pool in sender.data_planes:
      for lane in pool.lanes():
        lane._fault_hook = corrupt_once
    result = send(sender, config, state, codec=SMALL_CHUNKS)
    # The corrupted chunk was resent (CI once counted 2 resends here, a frame
    # beside it resent too; the receiver still rejected exactly the one).
    assert corrupted and result.timeline.resent_chunks >= 1
    received = rx.receiver.ready.get(timeout=10)
    assert received.timeline.rejected_chunks == 1
    assert_states_match(state, received.state, N)

    # Negative control: a chunk corrupted on every attempt fails the transfer
    # with DATA_LOSS naming its layer and chunk.
    def corrupt_always(lane, item, payload):
      if item.is_chunk and item.layer == 1:
        bad = bytearray(payload)
        bad[0] ^= 0xFF
        return memoryview(bad)
      return payload

    for pool in sender.data_planes:
      for lane in pool.lanes():
        lane._fault_hook = corrupt_always
    with pytest.raises(TransferError) as e:
      send(sender, config, state, codec=SMALL_CHUNKS)
  assert e.value.code == grpc.StatusCode.DATA_LOSS
  assert "layer 1, chunk 'layers/1/" in e.value.message and "crc32c" in e.value.message
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def test_receiver_that_stops_reading_bounds_sender_memory(config, state, make_rx):
  rx = make_rx(options={"idle_timeout_s": 2.0})
  gate = threading.Event()
  original = rx.receiver.plane_chunk

  def stuck(*args):
    gate.wait(30)  # this connection stops reading
    return original(*args)

  rx.receiver.plane_chunk = stuck
  options = SenderOptions(plane="tcp", lanes=2, window_bytes=16 << 10, **STREAMED,
                          max_inflight_bytes=32 << 10, rpc_timeout_s=30,
                          tuning=Tuning(stall_timeout_s=0.5, rate_bytes_per_s=1e6,
                                        rtt_s=1e-3))
  # 16 layers of ~4 KiB chunks: far more than the bounds below.
  big = random_state(config, [N], capacity=64, seed=4)
  with StateSender(rx.target, options=options) as sender:
    t0 = time.monotonic()
    with sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                      num_layers=config.n_layers, lengths=[N], codec=SMALL_CHUNKS) as tx:
      with pytest.raises(TransferError) as e:
        for i, layer in enumerate(big.layers):
          tx.send_layer(i, layer)
        tx.finish()
      timeline = tx.timeline()
    assert time.monotonic() - t0 < 20  # never a hang
  assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
  # What the sender queued and had unacknowledged stayed within its bounds.
  assert timeline.peak_queued_bytes <= 32 << 10
  assert timeline.bytes_sent < 3 * (2 * (16 << 10) + (32 << 10))
  gate.set()
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def _raw_frame(tid: bytes, key: bytes, payload: bytes, *, length=None, magic=frames.MAGIC):
  n = len(payload) if length is None else length
  header = frames.HEADER.pack(magic, frames.VERSION, frames.CHUNK, len(tid), 7, 0, 0, len(key),
                              n, 0)
  return header + tid + key + payload


def _reply(sock):
  return frames.read_reply(sock, waitall=True)


def test_bad_headers_refused_with_a_clear_error(config, state, make_rx):
  rx = make_rx(options={"max_message_bytes": 1 << 20})
  port = rx.data_plane.port
  with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    sock.sendall(_raw_frame(b"no-such-transfer", b"layers/0/k", b"x" * 100))
    seq, kind, code, message = _reply(sock)
    assert (seq, kind, code) == (7, frames.ERROR, grpc.StatusCode.NOT_FOUND)
    assert "no-such-transfer" in message
    # The connection stays usable after a refused transfer id.
    sock.sendall(_raw_frame(b"other", b"k", b""))
    assert _reply(sock)[2] == grpc.StatusCode.NOT_FOUND
  with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    sock.sendall(_raw_frame(b"t", b"k", b"", length=2 << 20))
    _, kind, code, message = _reply(sock)
    assert kind == frames.ERROR and code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds" in message
    assert sock.recv(1) == b""  # closed: the byte stream cannot be trusted
  with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    sock.sendall(_raw_frame(b"t", b"k", b"", magic=b"HTTP"))
    _, kind, code, message = _reply(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "magic" in message
  # Nothing leaked: no transfer, no budget, no connection thread left.
  assert_clean(rx)
  end = time.monotonic() + 5
  while time.monotonic() < end and rx.data_plane.open_connections:
    time.sleep(0.02)
  assert rx.data_plane.open_connections == 0
  # And the plane still works for a real sender.
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2)) as sender:
    send(sender, config, state)
  assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)


def test_plaintext_plane_beside_tls_grpc_is_refused(config, make_rx, pki):
  files, _ = pki
  decode = TLSConfig.from_files(files["decode-0"])
  with pytest.raises(ValueError, match="plaintext"):
    make_rx(credentials=decode.server())


def test_tcp_info_retransmits_reach_the_link_gauges(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2)) as sender:
    send(sender, config, state)
    lanes = [l for p in sender.data_planes for l in p.lanes()]
    infos = [l.tcp_info() for l in lanes]
    assert infos and all(i is not None and i.rtt_us > 0 for i in infos)  # Linux TCP_INFO
    assert sender.retransmits() == sum(i.total_retrans for i in infos)
    gauges = sender.counters.gauges()
    assert gauges["link_tcp_retransmits_total"] == sender.retransmits()
    # A source reporting loss shows up in the same gauge the live view reads.
    sender.counters.add_retransmit_source(lambda: 7)
    assert sender.counters.gauges()["link_tcp_retransmits_total"] == sender.retransmits() + 7


def test_serving_helpers_build_the_tls_plane_from_service_security(config, state, pki):
  """The serving stack's wiring (decode receiver_kwargs, prefill sender_fields)."""
  from paas_jax.security import ServiceSecurity
  files, _ = pki
  decode = ServiceSecurity(TLSConfig.from_files(files["decode-0"]), "decode")
  prefill = ServiceSecurity(TLSConfig.from_files(files["prefill-0"]), "prefill")
  broker = ServiceSecurity(TLSConfig.from_files(files["broker-0"]), "broker")
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=lambda info: (abstract_state(config, 1, 128), None))
  server = serve_receiver(receiver, credentials=decode.server_credentials(),
                          **dp_tls.receiver_kwargs(decode, "decode",
                                                   decode.server_credentials()))
  try:
    assert server.data_plane is not None and server.data_plane.ssl_context is not None
    for who, ok in ((prefill, True), (broker, False)):
      options = SenderOptions(credentials=who.channel_credentials(), rpc_timeout_s=30,
                              **dp_tls.sender_fields(who, 2))
      with StateSender(server.target, options=options) as sender:
        if ok:
          send(sender, config, state)
          assert_states_match(state, receiver.ready.get(timeout=10).state, N)
        else:  # a broker certificate may not push states (decode peer rules)
          with pytest.raises(TransferError) as e:
            send(sender, config, state)
          assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
  finally:
    server.stop(0)
  # gRPC TLS without a ServiceSecurity to build the plane's TLS from: no plane.
  assert dp_tls.receiver_kwargs(None, "decode", decode.server_credentials()) == {}
  plain = dp_tls.receiver_kwargs(None, "decode")
  assert plain["data_plane"] and "data_ssl" not in plain
