"""Begin and Commit on the data connections (BEGIN / COMMIT frames) and
cumulative acknowledgements (ACKS), with a real StateReceiver behind a real
gRPC port and real sockets."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from paas_jax.codec.manifest import StateManifest
from paas_jax.codec.store import crc32c
from paas_jax.codec.testing import assert_states_match
from paas_jax.proto import transport_pb2
from paas_jax.transport import transfer as transfer_mod
from paas_jax.transport import SenderOptions, StateSender, TransferError
from paas_jax.transport.dataplane import frames
from paas_jax.transport.dataplane.lanes import LanePool
from paas_jax.transport.dataplane.streams import LaneStream, Outgoing
from paas_jax.transport.dataplane.tuning import Tuning
from tests.transport.dataplane_rig import (N, SMALL_CHUNKS, STREAMED, assert_clean, receivers,
                                          send)


@pytest.fixture
def make_rx(config):
  with receivers(config) as make:
    yield make


def test_begin_and_commit_ride_warm_connections(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2, **STREAMED)) as sender:
    send(sender, config, state, codec=SMALL_CHUNKS)  # cold: gRPC Begin learns the plane
    assert rx.receiver.ready.get(timeout=10) is not None
    assert rx.rpcs["Begin"] == 1
    frames_before, replies_before = rx.data_plane.frames_total, rx.data_plane.replies_total
    for _ in range(3):
      result = send(sender, config, state, codec=SMALL_CHUNKS)
      received = rx.receiver.ready.get(timeout=10)
      assert_states_match(state, received.state, N)
      assert received.manifest == result.manifest
      assert received.info.peer.startswith("ipv4:127.0.0.1:")
    # No gRPC round trip for the three warm transfers: Begin and Commit were
    # frames on the data connections.
    assert rx.rpcs["Begin"] == 1 and rx.rpcs["Commit"] == 1 and rx.rpcs["Abort"] == 0
    # Stored frames are acknowledged in runs: fewer replies than frames.
    n_frames = rx.data_plane.frames_total - frames_before
    n_replies = rx.data_plane.replies_total - replies_before
    assert n_frames >= 3 * (len(result.manifest.chunk_index()) + 2)
    assert n_replies < n_frames
  assert_clean(rx)


def test_receiver_without_plane_control_keeps_grpc(config, state, make_rx):
  """Negative control of the above: the receiver does not announce
  data_plane_control (e.g. its gRPC port checks bearer tokens) -> every
  Begin and Commit stays on gRPC, and a BEGIN frame is refused."""
  rx = make_rx(data_control=False)
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2)) as sender:
    for _ in range(3):
      send(sender, config, state)
      assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  assert rx.rpcs["Begin"] == 3 and rx.rpcs["Commit"] == 3
  with socket.create_connection(("127.0.0.1", rx.data_plane.port), timeout=5) as sock:
    body = transport_pb2.BeginRequest(transfer_id="x").SerializeToString()
    sock.sendall(frames.pack_header(frames.BEGIN, 1, b"x", -1, b"", crc32c(body), len(body))
                 + body)
    seq, kind, code, message = frames.read_reply(sock, waitall=True)
    assert (seq, kind, code) == (1, frames.ERROR, grpc.StatusCode.UNIMPLEMENTED)
    assert "gRPC only" in message
  assert_clean(rx)


def _warm_sender(rx, config, state):
  sender = StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1))
  send(sender, config, state)
  rx.receiver.ready.get(timeout=10)
  return sender


def _hook_control(sender, rewrite):
  """Rewrites the payload of every COMMIT frame on the sender's connections."""

  def hook(lane, item, payload):
    return rewrite(payload) if item.kind == frames.COMMIT else payload

  for pool in sender.data_planes:
    pool.fault_hook = hook
    for lane in pool.lanes():
      lane._fault_hook = hook


def test_corrupted_commit_frame_is_refused(config, state, make_rx):
  rx = make_rx()
  with _warm_sender(rx, config, state) as sender:

    def flip(payload):
      bad = bytearray(payload)
      bad[len(bad) // 2] ^= 0xFF
      return memoryview(bad)

    _hook_control(sender, flip)
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    assert "COMMIT frame" in e.value.message and "crc32c mismatch" in e.value.message
    # Nothing was handed over, nothing is kept; the connections still work.
    assert rx.receiver.ready.empty()
    assert_clean(rx)
    _hook_control(sender, lambda payload: payload)
    send(sender, config, state)
    assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  assert rx.rpcs["Commit"] == 1  # all but the cold transfer committed on the plane


def test_commit_listing_a_chunk_never_sent_is_refused(config, state, make_rx, monkeypatch):
  """The commit check over the plane: a manifest that lists an object which
  never arrived (its layer changed after all its chunks had) is refused, and
  no state is handed over."""
  rx = make_rx()
  real_build = transfer_mod.build_manifest

  def with_phantom_chunk(*args, **kw):
    d = real_build(*args, **kw).to_dict()
    array = d["layers"][0]["arrays"][0]
    array["chunks"].append({"key": array["name"] + "/c/9/9/9", "nbytes": 4, "crc32c": 7})
    return StateManifest.from_dict(d)

  with _warm_sender(rx, config, state) as sender:
    monkeypatch.setattr(transfer_mod, "build_manifest", with_phantom_chunk)
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
  assert "layer 0 changed after all its chunks had arrived" in e.value.message
  assert rx.rpcs["Commit"] == 1  # refused on the plane, not over gRPC
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def test_begin_refused_on_the_plane_names_the_reason(config, state, make_rx):
  rx = make_rx()
  with _warm_sender(rx, config, state) as sender:
    with pytest.raises(TransferError) as e:
      sender.send_state(state, model_id=config.name, config_fingerprint="not-this-one")
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
  assert "fingerprint mismatch" in e.value.message
  assert rx.rpcs["Begin"] == 1  # the refused Begin was a frame, not an RPC
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def _fake_receiver(ack_offset: int):
  """A data-plane port that answers every frame with ACKS for seq + ack_offset."""
  listener = socket.create_server(("127.0.0.1", 0))

  def serve():
    conn, _ = listener.accept()
    with conn:
      header = bytearray(frames.HEADER.size)
      while True:
        try:
          frames.recv_exact(conn, memoryview(header), True)
          kind, seq, tid_len, _, _, key_len, length, _ = frames.parse_header(header)
          rest = bytearray(tid_len + key_len + length)
          frames.recv_exact(conn, memoryview(rest), True)
          conn.sendall(frames.pack_reply(seq + ack_offset, frames.ACKS))
        except OSError:  # incl. PeerClosed: the sender dropped the connection
          return

  threading.Thread(target=serve, daemon=True).start()
  return listener


@pytest.mark.parametrize("ack_offset", [0, 5])
def test_acks_of_frames_not_outstanding_break_the_connection(ack_offset):
  listener = _fake_receiver(ack_offset)
  pool = LanePool("127.0.0.1", listener.getsockname()[1], ssl_context=None,
                  window_bytes=1 << 20, tuning=Tuning())
  errors = []
  try:
    stream = LaneStream(pool, "t", lanes=1, max_queued_bytes=1 << 20,
                        deadline=time.monotonic() + 20, on_sent=lambda item, resend: None,
                        on_error=errors.append)
    for i in range(3):
      payload = b"x" * (i + 1)
      stream.put(Outgoing(frames.CHUNK, 0, f"layers/0/k/c/{i}", crc32c(payload), payload,
                          is_chunk=True))
    stream.close()
    if ack_offset == 0:  # control: correct cumulative acknowledgements
      stream.wait()
      assert not errors
    else:
      with pytest.raises(TransferError) as e:
        stream.wait()
      assert e.value.code == grpc.StatusCode.INTERNAL
      assert "not outstanding" in e.value.message
  finally:
    pool.close()
    listener.close()


def test_serving_wiring_keeps_control_on_grpc_behind_tokens(tmp_path):
  """The decode server's data plane takes Begin/Commit unless its gRPC port
  checks bearer tokens (which the data plane cannot)."""
  from paas_jax.security import ServiceSecurity, TokenSet, make_certs
  from paas_jax.security.tls import TLSConfig
  from paas_jax.transport.dataplane import tls as dp_tls
  tls = TLSConfig.from_files(make_certs(tmp_path, ("decode-0",))["decode-0"])
  assert dp_tls.receiver_kwargs(ServiceSecurity(tls, "decode"), "decode")["data_control"]
  tokens = TokenSet([("ops", "t" * 24)])
  kw = dp_tls.receiver_kwargs(ServiceSecurity(tls, "decode", tokens=tokens), "decode")
  assert kw["data_plane"] and kw["data_control"] is False


def _warm_send(rx, config, state, monkeypatch, *, lanes, wrap_begin, write_hook):
  """A warm transfer over ``lanes`` connections (after a cold one that learns
  the plane), the receiver's Begin replaced by ``wrap_begin(real_begin)`` and
  ``write_hook`` on every connection. Returns the TransferError, or None."""
  sender = StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=lanes, **STREAMED))
  send(sender, config, state, codec=SMALL_CHUNKS)  # cold: gRPC Begin learns the plane
  rx.receiver.ready.get(timeout=10)
  real_begin = rx.receiver._begin
  monkeypatch.setattr(rx.receiver, "_begin", wrap_begin(real_begin))
  for pool in sender.data_planes:
    pool.fault_hook = write_hook
    for lane in pool.lanes():
      lane._fault_hook = write_hook
  try:
    send(sender, config, state, codec=SMALL_CHUNKS)
    return None
  except TransferError as e:
    return e
  finally:
    sender.close()
    monkeypatch.setattr(rx.receiver, "_begin", real_begin)


def _pipelined_begin_run(rx, config, state, monkeypatch, hold_begin_frame=False):
  """A 4-connection warm transfer whose Begin takes 0.3 s at the receiver.
  Returns (error or None, the writes before Begin was answered: (lane, kind)),
  the BEGIN frame first. ``hold_begin_frame``: the connection that took BEGIN
  writes it only once another connection writes a frame (or after 5 s)."""
  answered = threading.Event()

  def wrap_begin(real_begin):
    def slow_begin(request, peer, **kwargs):
      time.sleep(0.3)
      try:
        return real_begin(request, peer, **kwargs)
      finally:
        answered.set()
    return slow_begin

  early = []
  other_lane_wrote = threading.Event()
  begin_lanes = []

  def record(lane, item, payload):
    if item.kind == frames.BEGIN:
      begin_lanes.append(lane.index)
      if hold_begin_frame:
        other_lane_wrote.wait(5)
    elif begin_lanes and lane.index != begin_lanes[-1]:
      other_lane_wrote.set()
    if not answered.is_set():
      early.append((lane.index, item.kind))
    return payload

  error = _warm_send(rx, config, state, monkeypatch, lanes=4, wrap_begin=wrap_begin,
                     write_hook=record)
  return error, early


def test_frames_follow_a_pipelined_begin_on_its_connection_only(config, state, make_rx,
                                                                monkeypatch):
  """A warm transfer does not wait for Begin's answer: its frames leave behind
  the BEGIN frame on that frame's connection (the receiver reads them after
  it), and the other connections wait for the answer."""
  rx = make_rx()
  error, early = _pipelined_begin_run(rx, config, state, monkeypatch)
  assert error is None
  assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  assert early[0][1] == frames.BEGIN
  assert any(kind == frames.CHUNK for _, kind in early)  # pipelined: no round trip first
  assert {lane for lane, _ in early} == {early[0][0]}
  assert_clean(rx)


def test_negative_control_ungated_pipelined_begin_fails(config, state, make_rx, monkeypatch):
  """Negative control of the above: without the gate, frames on the other
  connections reach the receiver before Begin and are refused. One frame per
  write, and BEGIN held until another connection writes, so that the outcome
  does not hang on whether one connection happened to batch every frame."""
  rx = make_rx()
  real_call_async = LaneStream.call_async
  real_take = LaneStream.take
  monkeypatch.setattr(LaneStream, "take",
                      lambda self, lane, room, max_frames, max_bytes, fit_room=False:
                      real_take(self, lane, room, 1, max_bytes, fit_room))
  # Lane writers only: the caller's own write of BEGIN would wait out the hold.
  monkeypatch.setattr(LaneStream, "write_through", lambda self: None)

  def ungated(self, kind, payload):
    item = real_call_async(self, kind, payload)
    with self._cv:
      self._begin_pending = False
      self._cv.notify_all()
    return item

  monkeypatch.setattr(LaneStream, "call_async", ungated)
  error, early = _pipelined_begin_run(rx, config, state, monkeypatch, hold_begin_frame=True)
  assert len({lane for lane, _ in early}) > 1
  assert error is not None and error.code == grpc.StatusCode.NOT_FOUND
  assert rx.receiver.ready.empty()
  assert_clean(rx)


def _begin_lane_lost_run(rx, config, state, monkeypatch, idempotent=True):
  """A 3-connection warm transfer whose BEGIN connection dies after the
  receiver ran Begin and before its answer left: the sender sends BEGIN (and
  the frames behind it) again on another connection. ``idempotent=False``:
  the receiver treats the repeated BEGIN as a new one. Returns (error or
  None, begin calls as (repeated, registered))."""
  begin_lanes, calls = [], []

  def note_begin_lane(lane, item, payload):
    if item.kind == frames.BEGIN:
      begin_lanes.append(lane)
    return payload

  def wrap_begin(real_begin):
    def begin_then_lose_connection(request, peer, repeated=False):
      try:
        return real_begin(request, peer, repeated=repeated and idempotent)
      finally:
        calls.append((repeated, request.transfer_id in rx.receiver._active))
        if len(calls) == 1:
          begin_lanes[0].sock.shutdown(socket.SHUT_RDWR)  # the answer cannot reach it
    return begin_then_lose_connection

  error = _warm_send(rx, config, state, monkeypatch, lanes=3, wrap_begin=wrap_begin,
                     write_hook=note_begin_lane)
  return error, calls


def test_begin_resent_when_its_connection_dies_unanswered(config, state, make_rx, monkeypatch):
  """A pipelined BEGIN whose connection dies before the answer: it is sent
  again (attempt > 0), the receiver answers as it did, the transfer completes."""
  rx = make_rx()
  error, calls = _begin_lane_lost_run(rx, config, state, monkeypatch)
  assert error is None
  assert calls == [(False, True), (True, True)]
  assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  assert_clean(rx)


def test_negative_control_repeated_begin_not_recognised_fails(config, state, make_rx,
                                                             monkeypatch):
  """Negative control of the above: a receiver that takes the repeated BEGIN
  for a new one refuses the transfer id as already used."""
  rx = make_rx()
  error, calls = _begin_lane_lost_run(rx, config, state, monkeypatch, idempotent=False)
  assert [repeated for repeated, _ in calls] == [False, True]
  assert error is not None and error.code == grpc.StatusCode.ALREADY_EXISTS
  assert rx.receiver.ready.empty()
  assert_clean(rx)
