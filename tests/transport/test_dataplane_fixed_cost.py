"""The data plane's fixed cost per transfer: the receiver's read-ahead
(``dataplane.framein``) and COMMIT armed to leave once every frame is
acknowledged (``LaneStream.call_when_drained``), over real sockets and a real
StateReceiver. Correctness only: no wall-clock assertions."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from paas_jax.codec.store import crc32c
from paas_jax.codec.testing import assert_states_match
from paas_jax.transport import SenderOptions, StateSender
from paas_jax.transport.dataplane import frames, framein
from paas_jax.transport.dataplane.streams import LaneStream
from tests.transport.dataplane_rig import (N, SMALL_CHUNKS, STREAMED, assert_clean, receivers,
                                          send)


def _frame(seq: int, key: bytes, payload: bytes) -> bytes:
  return frames.pack_header(frames.CHUNK, seq, b"t1", 0, key, crc32c(payload),
                            len(payload)) + payload


def _pair(data: bytes, sizes):
  """The reading end of a socketpair whose writer sends ``data`` in writes of
  ``sizes`` (cycled), then closes."""
  reader, writer = socket.socketpair()

  def write():
    with writer:
      i = n = 0
      while n < len(data):
        writer.sendall(data[n:n + sizes[i % len(sizes)]])
        n += sizes[i % len(sizes)]
        i += 1

  threading.Thread(target=write, daemon=True).start()
  return reader


def _read_frames(stream: framein.FrameInput, count: int):
  out = []
  for _ in range(count):
    kind, seq, tid_len, layer, crc, key_len, length, attempt = frames.parse_header(
        stream.take(frames.HEADER.size))
    names = stream.take(tid_len + key_len)
    key = str(names[tid_len:], "utf-8")
    data = bytearray(length)
    out.append((seq, key, crc, stream.read_payload(memoryview(data)), bytes(data)))
  return out


# Small frames, one larger than the read-ahead's small-payload limit (its head
# is read ahead, its tail straight into its buffer), small frames after it.
PAYLOADS = ([os.urandom(n) for n in (1, 324, 4096, 17)]
            + [os.urandom(3 * framein.SMALL_PAYLOAD_BYTES + 5)]
            + [os.urandom(n) for n in (4096, 0, 9)])


@pytest.mark.parametrize("sizes", [[1 << 20], [1, 7, 4093], [40, 100000]])
@pytest.mark.parametrize("waitall", [True, False])
def test_read_ahead_parses_frames_split_anywhere(sizes, waitall):
  wire = b"".join(_frame(i, f"k{i}".encode(), p) for i, p in enumerate(PAYLOADS))
  with _pair(wire, sizes) as reader:
    stream = framein.FrameInput(reader, waitall, size=framein.SMALL_PAYLOAD_BYTES * 2)
    got = _read_frames(stream, len(PAYLOADS))
    with pytest.raises(frames.PeerClosed):
      stream.take(frames.HEADER.size)
  for i, (seq, key, crc, arrived_crc, data) in enumerate(got):
    assert (seq, key, data) == (i, f"k{i}", PAYLOADS[i])
    assert arrived_crc == crc == crc32c(PAYLOADS[i])


def test_read_ahead_shares_reads_between_small_frames():
  """Many small frames in one write cost a few reads, not several per frame."""
  small = [os.urandom(300) for _ in range(50)]
  wire = b"".join(_frame(i, b"k", p) for i, p in enumerate(small))
  with _pair(wire, [len(wire)]) as reader:
    stream = framein.FrameInput(reader, True)
    got = _read_frames(stream, len(small))
  assert [data for *_, data in got] == small
  assert stream.recv_calls < len(small) // 4


def test_read_ahead_crc_covers_the_buffered_head_of_a_large_payload():
  """The crc of a payload whose head came out of the read-ahead covers that
  head: damage there is seen (negative control: the tail's crc alone)."""
  payload = bytearray(os.urandom(3 * framein.SMALL_PAYLOAD_BYTES))
  header = frames.pack_header(frames.CHUNK, 1, b"t1", 0, b"k", crc32c(payload), len(payload))
  payload[10] ^= 0x01  # inside the part read ahead together with the header
  with _pair(header + bytes(payload), [len(header) + 4096, 1 << 20]) as reader:
    stream = framein.FrameInput(reader, True)
    *_, crc, _, _, length, _ = frames.parse_header(stream.take(frames.HEADER.size))
    stream.take(3)
    assert 0 < stream.buffered < length
    head = stream.buffered
    data = bytearray(length)
    arrived = stream.read_payload(memoryview(data))
  assert bytes(data) == bytes(payload)
  assert arrived == crc32c(payload) != crc
  assert crc32c(memoryview(data)[head:]) != arrived


def _warm_commit_run(config, state, release_early=False, monkeypatch=None):
  """A warm one-connection transfer whose first layer-1 chunk is corrupted
  once on the wire (NACKed, resent). Returns (the receiver's Commit answers
  as complete flags, the writes as (kind, layer, attempt, thread name), the
  received state). ``release_early``: the armed COMMIT is queued at once
  instead of after the last acknowledgement (the gate removed), and the
  first write waits until it is queued, so that it follows the first batch
  of frames before the NACK of the corrupted one is back."""
  with receivers(config) as make:
    rx = make()
    commits, writes, corrupted = [], [], []
    commit_queued = threading.Event()
    real_commit = rx.receiver._commit

    def commit(request):
      response = real_commit(request)
      commits.append(response.complete)
      return response

    rx.receiver._commit = commit
    if release_early:
      def queued_at_once(self, kind, payload):
        item = LaneStream.call_async(self, kind, payload)
        commit_queued.set()
        return item

      monkeypatch.setattr(LaneStream, "call_when_drained", queued_at_once)
      # Lane writers only: the hook holds the first write until COMMIT is
      # queued, which the caller's own write of BEGIN would wait out.
      monkeypatch.setattr(LaneStream, "write_through", lambda self: None)

    def hook(lane, item, payload):
      if release_early and not writes:
        commit_queued.wait(5)
      writes.append((item.kind, item.layer, item.attempt, threading.current_thread().name))
      if item.is_chunk and item.layer == 1 and not corrupted:
        corrupted.append(item.key)
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return memoryview(bad)
      return payload

    with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1,
                                                      **STREAMED)) as sender:
      send(sender, config, state, codec=SMALL_CHUNKS)  # cold: gRPC Begin learns the plane
      rx.receiver.ready.get(timeout=10)
      commits.clear()
      for pool in sender.data_planes:
        for lane in pool.lanes():
          lane._fault_hook = hook
      send(sender, config, state, codec=SMALL_CHUNKS)
      received = rx.receiver.ready.get(timeout=10)
    assert corrupted
    assert_clean(rx)
    return commits, writes, received


def test_armed_commit_waits_for_every_acknowledgement(config, state):
  """COMMIT leaves only once every frame, the resent one included, is
  acknowledged: the receiver's first Commit finds the state complete, and
  COMMIT is written after the resend and from a lane thread (the reader
  that saw the last acknowledgement, or the writer), not the caller."""
  commits, writes, received = _warm_commit_run(config, state)
  assert commits == [True]
  kinds = [kind for kind, *_ in writes]
  assert kinds.count(frames.COMMIT) == 1
  commit_at = kinds.index(frames.COMMIT)
  resent = [i for i, (kind, layer, attempt, _) in enumerate(writes)
            if kind == frames.CHUNK and attempt > 0]
  assert resent and max(resent) < commit_at == len(writes) - 1
  assert writes[commit_at][3].startswith("dp-lane")
  assert_states_match(state, received.state, N)


def test_negative_control_commit_released_early_finds_state_incomplete(config, state,
                                                                       monkeypatch):
  """Negative control of the above: COMMIT queued behind the frames without
  waiting for their acknowledgements reaches the receiver before the resent
  chunk, which answers incomplete; the sender resends and commits again."""
  commits, writes, received = _warm_commit_run(config, state, release_early=True,
                                               monkeypatch=monkeypatch)
  assert commits[0] is False and commits[-1] is True
  assert [kind for kind, *_ in writes].count(frames.COMMIT) == len(commits) >= 2
  assert_states_match(state, received.state, N)


def _inbound_with_descriptors(config, state):
  """An Inbound that adopted every descriptor of ``state`` (as the receiver's
  descriptor frames do), and the manifest a sender would commit."""
  from paas_jax import codec
  from paas_jax.codec.encode import build_manifest
  from paas_jax.codec.options import CodecOptions
  from paas_jax.transport.inbound import Inbound, TransferInfo
  from paas_jax.transport.ingress import _parse_descriptor
  groups = list(codec.encode_groups(state))
  info = TransferInfo("t1", config.name, config.fingerprint(), config.n_layers, N,
                      CodecOptions(), "ipv4:127.0.0.1:1")
  t = Inbound(info, None, 0.0, 1e9)
  serialized = {}
  for g in groups:
    text = g.entry.to_json()
    serialized[g.entry.index] = (g.entry, text)
    entry, raw = _parse_descriptor(text, g.entry.index)
    t.descriptors[entry.index], t.descriptor_json[entry.index] = entry, raw
  manifest = build_manifest([g.entry for g in groups], model_id=config.name,
                            config_fingerprint=config.fingerprint(), token_count=N, batch=1,
                            options=CodecOptions())
  return t, manifest, serialized


def test_spliced_manifest_reuses_the_adopted_descriptors(config, state):
  from paas_jax.codec.manifest import StateManifest
  from paas_jax.transport.inbound import manifest_from_descriptors
  t, manifest, serialized = _inbound_with_descriptors(config, state)
  text = manifest.to_json(serialized)
  got = manifest_from_descriptors(text, t)
  assert got == manifest == StateManifest.from_json(text)
  assert all(g is t.descriptors[g.index] for g in got.groups)  # not parsed again
  # Negative controls: anything but the spliced texts is left to the full
  # parse (None), however close it is.
  assert manifest_from_descriptors(manifest.to_json(), t) is None  # other key order/spacing
  head_end = text.index(',"layers":[')
  i = text.index('"nbytes":', head_end) + len('"nbytes":')
  one_off = text[:i] + ("9" if text[i] != "9" else "8") + text[i + 1:]  # a layer's size
  assert manifest_from_descriptors(one_off, t) is None
  with_layers_in_head = text[:head_end] + ',"layers":[]' + text[head_end:]
  assert manifest_from_descriptors(with_layers_in_head, t) is None
  broken_head = '{"format":"' + text[head_end:]
  assert manifest_from_descriptors(broken_head, t) is None
  t.descriptor_json.pop(0)
  assert manifest_from_descriptors(text, t) is None  # a descriptor never arrived


def test_spliced_manifest_header_is_still_checked(config, state, monkeypatch):
  """A warm transfer commits through the fast path (no full parse), and a
  spliced manifest whose header names another model is still refused."""
  from paas_jax.codec.manifest import StateManifest
  from paas_jax.transport import receiver as receiver_mod
  from paas_jax.transport import transfer as transfer_mod
  from paas_jax.transport import TransferError
  import grpc
  full_parses = []
  real_from_json = StateManifest.from_json
  monkeypatch.setattr(receiver_mod.StateManifest, "from_json",
                      lambda *a, **kw: full_parses.append(1) or real_from_json(*a, **kw))
  with receivers(config) as make:
    rx = make()
    with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
      send(sender, config, state, codec=SMALL_CHUNKS)  # cold
      rx.receiver.ready.get(timeout=10)
      full_parses.clear()
      result = send(sender, config, state, codec=SMALL_CHUNKS)
      received = rx.receiver.ready.get(timeout=10)
      assert full_parses == [] and received.manifest == result.manifest
      assert_states_match(state, received.state, N)
      real_request = transfer_mod.Transfer._commit_request

      def other_model(self, manifest):
        request = real_request(self, manifest)
        spliced = request.manifest_json.replace(
            f'"model_id":"{config.name}"', '"model_id":"someone-else"', 1)
        assert spliced != request.manifest_json
        request.manifest_json = spliced
        return request

      monkeypatch.setattr(transfer_mod.Transfer, "_commit_request", other_model)
      with pytest.raises(TransferError) as e:
        send(sender, config, state, codec=SMALL_CHUNKS)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "someone-else" in e.value.message and full_parses == []
    assert rx.receiver.ready.empty()
    assert_clean(rx)


def _slow_run(config, state, *, slow_chunks_s=0.0, commit_hang_s=0.0):
  """A warm transfer with ``commit_timeout_s=0.5``; the receiver spends
  ``slow_chunks_s`` on the transfer's chunks (spread over its first ten) or
  ``commit_hang_s`` in Commit. Returns the TransferError or None."""
  import time
  from paas_jax.transport import TransferError
  with receivers(config) as make:
    rx = make()
    with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1,
                                                      commit_timeout_s=0.5)) as sender:
      send(sender, config, state, codec=SMALL_CHUNKS)  # cold
      rx.receiver.ready.get(timeout=10)
      real_chunk, real_commit, seen = rx.receiver.plane_chunk, rx.receiver._commit, []

      def slow_chunk(*args):
        if len(seen) < 10:
          seen.append(1)
          time.sleep(slow_chunks_s / 10)
        return real_chunk(*args)

      def hung_commit(request):
        time.sleep(commit_hang_s)
        return real_commit(request)

      rx.receiver.plane_chunk, rx.receiver._commit = slow_chunk, hung_commit
      try:
        send(sender, config, state, codec=SMALL_CHUNKS)
        assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
        return None
      except TransferError as e:
        return e
      finally:
        assert_clean(rx)


def test_armed_commit_timeout_counts_from_its_write(config, state):
  """COMMIT's timeout starts when it is written, not when it was armed: a
  transfer whose frames take longer than commit_timeout_s to be acknowledged
  still commits."""
  assert _slow_run(config, state, slow_chunks_s=1.5) is None


def test_negative_control_commit_that_hangs_times_out(config, state):
  """Negative control: a Commit that does not answer within commit_timeout_s
  of COMMIT's write fails the transfer with DEADLINE_EXCEEDED."""
  import grpc
  error = _slow_run(config, state, commit_hang_s=2.0)
  assert error is not None and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
  assert "no reply to COMMIT" in error.message

