"""Small states as one BUNDLE frame (dataplane/bundle.py, transport/bundler.py,
transport/bundle_ingress.py): real sockets, a real StateReceiver behind a real
gRPC port, plaintext and mTLS. Correctness only, never wall-clock time."""

from __future__ import annotations

import socket

import grpc
import pytest

from paas_jax import codec
from paas_jax.codec.store import crc32c
from paas_jax.codec.testing import assert_states_match
from paas_jax.proto import transport_pb2
from paas_jax.security import ca as ca_lib
from paas_jax.security.tls import TLSConfig
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                TransferError, bundle_ingress, serve_receiver)
from paas_jax.transport.bundler import Bundler
from paas_jax.transport.dataplane import bundle as bundle_lib, frames, tls as dp_tls
from tests.transport.dataplane_rig import N, assert_clean, receivers, send


@pytest.fixture(scope="module")
def blobs(state):
  """Every object of ``state`` as the sender encodes it (deterministic)."""
  return {k: bytes(v) for g in codec.encode_groups(state) for k, v in g.blobs.items()}


@pytest.fixture
def make_rx(config):
  with receivers(config) as make:
    yield make


@pytest.fixture
def store_rx(config):
  """A receiver without a template: it hands over the verified objects, so a
  test can compare them byte by byte with what was encoded."""
  started = []

  def make(**kw):
    receiver = StateReceiver(models={config.name: config.fingerprint()},
                             options=ReceiverOptions(**kw.pop("options", {})))
    server = serve_receiver(receiver, data_plane=True, **kw)
    started.append(server)
    return server

  yield make
  for server in started:
    server.stop(0)


def _record_kinds(sender, kinds, hook=None):
  """Every frame kind each of the sender's connections writes, in order
  (``hook``: a fault hook to apply after recording)."""

  def record(lane, item, payload):
    kinds.append(item.kind)
    return payload if hook is None else hook(lane, item, payload)

  for pool in sender.data_planes:
    pool.fault_hook = record
    for lane in pool.lanes():
      lane._fault_hook = record


def _warm(sender, rx, config, state):
  """A cold transfer (gRPC Begin learns the plane and opens the connections)."""
  send(sender, config, state)
  rx.receiver.ready.get(timeout=10)


def test_small_state_is_one_frame_and_byte_exact(config, state, blobs, store_rx):
  rx = store_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=2)) as sender:
    _warm(sender, rx, config, state)
    kinds = []
    _record_kinds(sender, kinds)
    before = rx.data_plane.frames_total
    for _ in range(3):
      result = send(sender, config, state)
      received = rx.receiver.ready.get(timeout=10)
      assert received.store.read_all() == blobs  # byte-exact, every object
      assert received.manifest == result.manifest
      tl = result.timeline
      assert tl.bytes_sent == tl.state_bytes == sum(len(b) for b in blobs.values())
      assert tl.chunks_sent == len(blobs) and tl.resent_chunks == 0
      assert received.timeline.chunks_received == len(blobs)
      received.release()
    # BEGIN, one BUNDLE, COMMIT per warm transfer: nothing else.
    assert kinds == [frames.BEGIN, frames.BUNDLE, frames.COMMIT] * 3
    assert rx.data_plane.frames_total - before == 9
  assert rx.receiver.active_transfers() == [] and rx.receiver.bytes_in_use == 0


def test_bundle_round_trip_token_exact_over_mtls(config, state, make_rx, tmp_path):
  files = ca_lib.make_certs(tmp_path, ("prefill-0", "decode-0"))
  decode, prefill = (TLSConfig.from_files(files[n]) for n in ("decode-0", "prefill-0"))
  rx = make_rx(credentials=decode.server(), data_ssl=dp_tls.server_context(decode),
               data_peers=["prefill*"])
  options = SenderOptions(plane="tcp", lanes=2, credentials=prefill.client(),
                          data_ssl=dp_tls.client_context(prefill), rpc_timeout_s=30)
  with StateSender(rx.target, options=options) as sender:
    _warm(sender, rx, config, state)
    kinds = []
    _record_kinds(sender, kinds)
    for _ in range(2):
      send(sender, config, state)
      assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
    assert kinds.count(frames.BUNDLE) == 2 and frames.CHUNK not in kinds
  assert_clean(rx)


def _flip_bundle(times: int | None, corrupted: list):
  """A fault hook: the BUNDLE's last byte (inside its last object) flipped on
  the wire, the first ``times`` writes of it (None: every one)."""

  def hook(lane, item, payload):
    if item.kind == frames.BUNDLE and (times is None or len(corrupted) < times):
      corrupted.append(item.attempt)
      bad = bytearray(payload)
      bad[-1] ^= 0xFF
      return memoryview(bad)
    return payload

  return hook


def test_a_nack_read_while_the_frame_is_written_counts_only_the_resend(
    config, state, blobs, store_rx):
  """The receiver can refuse a frame before the writer has noted it written
  (seen once under load: the first write counted as a resend too, 2x the
  objects resent). Simulated: the first BUNDLE is marked a resend while it is
  written; only the real resend counts."""
  rx = store_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    _warm(sender, rx, config, state)
    corrupted = []
    flip = _flip_bundle(1, corrupted)

    def nack_during_write(lane, item, payload):
      out = flip(lane, item, payload)
      if item.kind == frames.BUNDLE and item.attempt == 0:
        item.resend = True  # what ``LaneStream.nacked`` does
      return out

    _record_kinds(sender, [], nack_during_write)
    result = send(sender, config, state)
    rx.receiver.ready.get(timeout=10).release()
  assert corrupted == [0] and result.timeline.resent_chunks == len(blobs)


def test_corrupted_bundle_is_refused_by_name_and_resent(config, state, blobs, store_rx):
  rx = store_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    _warm(sender, rx, config, state)
    corrupted, kinds = [], []
    _record_kinds(sender, kinds, _flip_bundle(1, corrupted))
    result = send(sender, config, state)
    received = rx.receiver.ready.get(timeout=10)
    assert corrupted == [0]
    # COMMIT follows the first BUNDLE at once: it went before the NACK (then
    # answered incomplete and sent again once the resent BUNDLE landed) or
    # behind the resent one. Never object by object.
    assert kinds in ([frames.BEGIN, frames.BUNDLE, frames.BUNDLE, frames.COMMIT],
                     [frames.BEGIN, frames.BUNDLE, frames.COMMIT, frames.BUNDLE, frames.COMMIT])
    assert received.timeline.rejected_chunks == 1  # one bundle refused, nothing of it kept
    assert result.timeline.resent_chunks == len(blobs)  # resent whole
    assert received.store.read_all() == blobs
    received.release()
    # Corrupted on every attempt: DATA_LOSS naming the bundle and the check.
    _record_kinds(sender, [], _flip_bundle(None, corrupted))
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
  assert e.value.code == grpc.StatusCode.DATA_LOSS
  assert f"bundle of layers -1..{config.n_layers - 1}" in e.value.message
  assert "crc32c mismatch" in e.value.message
  assert rx.receiver.ready.empty()
  assert rx.receiver.active_transfers() == [] and rx.receiver.bytes_in_use == 0


def test_negative_control_unchecked_bundle_commits_a_wrong_state(config, state, blobs,
                                                                 store_rx, monkeypatch):
  """Without the crc32c checks (frame and objects) the same damaged bundle is
  adopted and committed: the receiver would hand over a wrong state. So the
  test above is what the checks catch."""
  monkeypatch.setattr(bundle_ingress, "frame_failure", lambda crc, data_crc: None)
  monkeypatch.setattr(bundle_ingress, "objects_failure", lambda objects: None)
  rx = store_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    _warm(sender, rx, config, state)
    corrupted = []
    _record_kinds(sender, [], _flip_bundle(1, corrupted))
    send(sender, config, state)
    received = rx.receiver.ready.get(timeout=10)
  got = received.store.read_all()
  assert corrupted == [0] and set(got) == set(blobs)
  assert [k for k in blobs if got[k] != blobs[k]] != []  # committed, and wrong
  received.release()


def test_only_objects_check_catches_a_sender_side_mismatch(config, state, store_rx,
                                                           monkeypatch):
  """The per-object check on its own: a bundle whose frame crc32c matches but
  whose object differs from its descriptor (damaged before the bundle was
  packed) is refused, never adopted."""
  rx = store_rx()
  real_pack = bundle_lib.pack

  def damaged_pack(groups):
    payload = bytearray(real_pack(groups))
    payload[-1] ^= 0xFF  # before the sender computes the frame's crc32c
    return bytes(payload)

  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    _warm(sender, rx, config, state)
    monkeypatch.setattr(bundle_lib, "pack", damaged_pack)
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
  assert e.value.code == grpc.StatusCode.DATA_LOSS
  assert "its descriptor says" in e.value.message and ", chunk '" in e.value.message
  assert rx.receiver.ready.empty()


def test_killed_connection_mid_bundle_is_resent_on_a_new_one(config, state, make_rx):
  rx = make_rx()
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    _warm(sender, rx, config, state)
    killed = []

    def kill_once(lane, item, payload):
      if item.kind == frames.BUNDLE and not killed:
        killed.append(lane.index)
        lane.sock.shutdown(socket.SHUT_RDWR)  # dies with the BUNDLE unacknowledged
      return payload

    _record_kinds(sender, [], kill_once)
    result = send(sender, config, state)
    assert killed and result.timeline.resent_chunks >= 1
    assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
    assert {l.index for p in sender.data_planes for l in p.lanes()} != set(killed)

    # Every connection keeps dying: UNAVAILABLE, nothing handed over or kept.
    def kill_all(lane, item, payload):
      lane.sock.shutdown(socket.SHUT_RDWR)
      return payload

    _record_kinds(sender, [], kill_all)
    with pytest.raises(TransferError) as e:
      send(sender, config, state)
  assert e.value.code == grpc.StatusCode.UNAVAILABLE
  assert rx.receiver.ready.empty()
  assert_clean(rx)


@pytest.mark.parametrize("bundle_bytes", [0, 1024, 12 << 10])
def test_states_above_the_threshold_take_the_per_frame_path(config, state, make_rx,
                                                            bundle_bytes):
  """0: never bundled; 1 KiB: no group fits; 12 KiB: the first groups are held
  and then released, in order, as ordinary frames when the next one would
  pass the threshold. Either way no BUNDLE, one frame per object."""
  rx = make_rx()
  options = SenderOptions(plane="tcp", lanes=2, bundle_bytes=bundle_bytes)
  with StateSender(rx.target, options=options) as sender:
    _warm(sender, rx, config, state)
    kinds = []
    _record_kinds(sender, kinds)
    result = send(sender, config, state)
    assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
  assert frames.BUNDLE not in kinds
  assert kinds.count(frames.CHUNK) == len(result.manifest.chunk_index())
  assert kinds.count(frames.DESCRIPTOR) == config.n_layers + 1
  assert_clean(rx)


def test_bundler_holds_until_the_threshold_then_releases_in_order(state):
  groups = list(codec.encode_groups(state))
  texts = [g.entry.to_json() for g in groups]
  size = lambda gs: 4 + sum(8 + len(t) + g.entry.nbytes for g, t in gs)
  limit = size(list(zip(groups, texts))[:2])
  b = Bundler(limit)
  assert b.hold(groups[0], texts[0]) is None and b.hold(groups[1], texts[1]) is None
  out = b.hold(groups[2], texts[2])
  assert [(i.kind, i.layer) for i in out if i.kind == frames.DESCRIPTOR] == [
      (frames.DESCRIPTOR, g.entry.index) for g in groups[:3]]
  assert b.take() is None and len(b.hold(groups[3], texts[3])) > 0  # streams from then on
  whole = Bundler(size(list(zip(groups, texts))))
  assert all(whole.hold(g, t) is None for g, t in zip(groups, texts))
  item = whole.take()
  assert item.kind == frames.BUNDLE and item.crc == crc32c(item.payload)
  assert [layer for layer, _, _ in item.groups] == [g.entry.index for g in groups]
  rows, offset = bundle_lib.parse(item.payload)
  assert [text for _, _, text in rows] == texts
  assert len(item.payload) - offset == sum(g.entry.nbytes for g in groups)


@pytest.mark.parametrize("payload, match", [
    (b"", "shorter than its table"),
    (bundle_lib.COUNT.pack(0), "table of 0 groups"),
    (bundle_lib.COUNT.pack(3) + bundle_lib.ROW.pack(0, 2), "does not fit"),
    (bundle_lib.COUNT.pack(1) + bundle_lib.ROW.pack(0, 99) + b"{}", "do not fit"),
    (bundle_lib.COUNT.pack(1) + bundle_lib.ROW.pack(0, 2) + b"\xff{", "not ASCII"),
    (bundle_lib.COUNT.pack(1) + bundle_lib.ROW.pack(0, 2) + b"{]", "do not parse"),
    (bundle_lib.COUNT.pack(2) + bundle_lib.ROW.pack(0, 2) + bundle_lib.ROW.pack(1, 0)
     + b"{}", "do not parse"),
    (bundle_lib.COUNT.pack(1) + bundle_lib.ROW.pack(0, 7) + b"{},{}  ", "2 objects parsed"),
])
def test_malformed_tables_do_not_parse(payload, match):
  with pytest.raises(bundle_lib.BundleMalformed, match=match):
    bundle_lib.parse(payload)


def _open_transfer(rx, config, tid: str) -> None:
  rx.receiver._begin(transport_pb2.BeginRequest(
      transfer_id=tid, model_id=config.name, config_fingerprint=config.fingerprint(),
      num_layers=config.n_layers, token_count=N), "test")


def _bundle_frame(tid: bytes, payload: bytes, *, length=None, kind=frames.BUNDLE) -> bytes:
  label = b"bundle of layers 0..0 (1 groups)"
  return frames.pack_header(kind, 7, tid, -1, label, crc32c(payload),
                            len(payload) if length is None else length) + payload


def test_malformed_or_oversize_bundle_refused_with_a_clear_error(config, state, make_rx):
  rx = make_rx(options={"max_message_bytes": 1 << 20})
  port = rx.data_plane.port
  group = next(iter(codec.encode_groups(state)))
  whole = bundle_lib.pack([(group.entry, group.entry.to_json(),
                            [group.blobs[c.key] for _, c in group.entry.chunks()])])
  cases = [
      (b"t-garbage", bundle_lib.COUNT.pack(1) + b"garbage!", "malformed"),
      (b"t-short", whole[:-1], "its descriptors list"),  # an object cut short
      (b"t-long", whole + b"x", "its descriptors list"),
  ]
  for tid, payload, match in cases:
    _open_transfer(rx, config, tid.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
      sock.sendall(_bundle_frame(tid, payload))
      seq, kind, code, message = frames.read_reply(sock, waitall=True)
      assert (seq, kind, code) == (7, frames.ERROR, grpc.StatusCode.INVALID_ARGUMENT)
      assert "bundle of layers 0..0" in message and match in message
    # The transfer failed as a whole: nothing of it is kept.
    assert rx.receiver.failure(tid.decode())[0] == grpc.StatusCode.INVALID_ARGUMENT
  with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    sock.sendall(_bundle_frame(b"t-big", b"", length=2 << 20))
    _, kind, code, message = frames.read_reply(sock, waitall=True)
    assert kind == frames.ERROR and code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds" in message
    assert sock.recv(1) == b""  # closed: the byte stream cannot be trusted
  with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
    sock.sendall(_bundle_frame(b"t-kind", b"", kind=9))
    _, kind, code, message = frames.read_reply(sock, waitall=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown frame kind 9" in message
  assert rx.receiver.ready.empty()
  assert_clean(rx)
  # The plane still works for a real sender.
  with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
    send(sender, config, state)
  assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)


def test_a_bundle_arriving_twice_is_kept_once(config, state, make_rx):
  """A bundle resent after its connection died although the receiver had
  adopted it (the acknowledgement was lost) takes the per-object path: it is
  acknowledged again, nothing is counted twice, and Commit finds the state."""
  rx = make_rx()
  sink = rx.receiver
  _open_transfer(rx, config, "twice")
  groups = list(codec.encode_groups(state))
  texts = {g.entry.index: g.entry.to_json() for g in groups}
  payload = bundle_lib.pack([(g.entry, texts[g.entry.index],
                              [g.blobs[c.key] for _, c in g.entry.chunks()]) for g in groups])
  crc = crc32c(payload)
  t = sink.plane_lookup("twice")
  assert sink.plane_bundle(t, "b", crc, bytearray(payload), crc) is None
  held = sink.bytes_in_use
  assert sink.plane_bundle(t, "b", crc, bytearray(payload), crc) is None
  assert sink.bytes_in_use == held and t.chunks_received == sum(len(g.blobs) for g in groups)
  manifest = codec.build_manifest([g.entry for g in groups], model_id=config.name,
                                  config_fingerprint=config.fingerprint(), token_count=N,
                                  batch=1, options=codec.CodecOptions())
  spliced = manifest.to_json({i: (manifest.group(i), texts[i]) for i in texts})
  response = transport_pb2.CommitResponse.FromString(sink.plane_commit(
      transport_pb2.CommitRequest(transfer_id="twice", manifest_json=spliced)
      .SerializeToString()))
  assert response.complete
  assert_states_match(state, sink.ready.get(timeout=10).state, N)
  assert_clean(rx)
