"""Who writes a data-plane transfer's frames, and in which order: the caller
writes BEGIN and a BUNDLE itself when the connection is free
(``LaneStream.write_through``), every writer takes frames under the lane's
write lock, and COMMIT rides right behind a BUNDLE on its connection
(``LaneStream.call_after``). Real sockets and a real StateReceiver;
correctness only, no wall-clock assertions."""

from __future__ import annotations

import threading
import time

from paas_jax.codec.testing import assert_states_match
from paas_jax.transport import SenderOptions, StateSender, TransferError
from paas_jax.transport.dataplane import frames, lanes as lanes_mod
from paas_jax.transport.dataplane.streams import LaneStream
from tests.transport.dataplane_rig import N, assert_clean, receivers, send


def _write_through_run(config, state, monkeypatch, *, hold_begin_s=0.0,
                       take_outside_write_lock=False):
  """Two warm one-connection transfers of a state small enough for one BUNDLE
  frame (the first, cold one learns the plane). Returns (the second's error
  or None, its writes as (kind, writing thread's name, lane index), the
  caller's thread name). ``hold_begin_s``: a lane writer that took BEGIN
  holds it that long before writing it, and the caller's write-throughs start late enough for
  that writer to take BEGIN first. ``take_outside_write_lock``: lane
  writers take frames before they get the write lock (the order bug that
  taking under it rules out)."""
  real_take, real_through = LaneStream.take, LaneStream.write_through

  def take(self, lane, room, max_frames, max_bytes, fit_room=False):
    items = real_take(self, lane, room, max_frames, max_bytes, fit_room)
    if (hold_begin_s and threading.current_thread().name.endswith("-tx")
        and any(item.kind == frames.BEGIN for item in items)):
      time.sleep(hold_begin_s)
    return items

  def write_through(self):
    if hold_begin_s:
      time.sleep(hold_begin_s / 10)
    real_through(self)

  def write_queued_taking_first(self, stream):
    with self._cv:
      room = self._window - self._unacked_bytes
    items = stream.take(self, room, lanes_mod.BATCH_FRAMES, lanes_mod.BATCH_BYTES)
    if items:
      with self._wlock:
        self._send(items)

  monkeypatch.setattr(LaneStream, "take", take)
  monkeypatch.setattr(LaneStream, "write_through", write_through)
  if take_outside_write_lock:
    monkeypatch.setattr(lanes_mod.Lane, "_write_queued", write_queued_taking_first)
  writes = []

  def hook(lane, item, payload):
    writes.append((item.kind, threading.current_thread().name, lane.index))
    return payload

  with receivers(config) as make:
    rx = make()
    with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=1)) as sender:
      send(sender, config, state)  # cold: gRPC Begin learns the plane
      rx.receiver.ready.get(timeout=10)
      for pool in sender.data_planes:
        for lane in pool.lanes():
          lane._fault_hook = hook
      error = None
      try:
        send(sender, config, state)
        assert_states_match(state, rx.receiver.ready.get(timeout=10).state, N)
      except TransferError as e:
        error = e
    assert_clean(rx)
  return error, writes, threading.current_thread().name


def test_caller_writes_begin_and_bundle_itself(config, state, monkeypatch):
  """A warm small transfer's BEGIN and BUNDLE leave from the caller's own
  thread (no lane writer has to wake up and get the interpreter), COMMIT
  right behind the BUNDLE on its connection."""
  error, writes, caller = _write_through_run(config, state, monkeypatch)
  assert error is None
  assert [kind for kind, _, _ in writes] == [frames.BEGIN, frames.BUNDLE, frames.COMMIT]
  assert [who for _, who, _ in writes[:2]] == [caller, caller]
  assert len({lane for _, _, lane in writes}) == 1


def test_frames_keep_queue_order_when_caller_and_writer_race(config, state, monkeypatch):
  """A lane writer that took BEGIN and is slow to write it holds the write
  lock, so the caller's write-through cannot put the BUNDLE on the wire
  first; the transfer commits."""
  error, writes, _ = _write_through_run(config, state, monkeypatch, hold_begin_s=1.0)
  assert error is None
  assert [kind for kind, _, _ in writes] == [frames.BEGIN, frames.BUNDLE, frames.COMMIT]
  assert writes[0][1].startswith("dp-lane")  # the race happened: the writer took BEGIN


def test_negative_control_taking_outside_the_write_lock_reorders(config, state,
                                                                 monkeypatch):
  """Negative control of the above: a writer that takes BEGIN before it holds
  the write lock lets the caller write the BUNDLE ahead of it; the receiver
  refuses a frame of a transfer it has not begun."""
  error, writes, _ = _write_through_run(config, state, monkeypatch, hold_begin_s=1.0,
                                        take_outside_write_lock=True)
  assert writes[0][0] == frames.BUNDLE  # BEGIN after it, or never: the lane died first
  assert error is not None


def _pipelined_commit_run(config, state, monkeypatch, *, hold_bundle_s=0.0,
                          corrupt_bundle=False, unpinned=False):
  """Two warm four-connection transfers of a one-BUNDLE state. Returns (the
  receiver's Commit answers of the second as complete flags, its writes as
  (kind, attempt, lane index), the received state). ``hold_bundle_s``: the
  connection writing the BUNDLE stalls that long first (its write lock
  held). ``corrupt_bundle``: its first write is damaged (NACKed, resent).
  ``unpinned``: COMMIT may go on any connection (``call_after`` is
  ``call_async``).
  Frames are written by the lanes' writer threads only, one per write."""
  if unpinned:
    monkeypatch.setattr(LaneStream, "call_after",
                        lambda self, kind, payload, after: self.call_async(kind, payload))
  # Lane writers only, so that a stalled BUNDLE write holds up its lane, not
  # the caller (who queues COMMIT meanwhile); one frame per write, so that
  # COMMIT is not simply batched with the BUNDLE.
  monkeypatch.setattr(LaneStream, "write_through", lambda self: None)
  real_take = LaneStream.take
  monkeypatch.setattr(LaneStream, "take",
                      lambda self, lane, room, max_frames, max_bytes, fit_room=False:
                      real_take(self, lane, room, 1, max_bytes, fit_room))
  writes, commits = [], []

  def hook(lane, item, payload):
    writes.append((item.kind, item.attempt, lane.index))
    if item.kind == frames.BUNDLE and item.attempt == 0:
      time.sleep(hold_bundle_s)
      if corrupt_bundle:
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return memoryview(bad)
    return payload

  with receivers(config) as make:
    rx = make()
    real_commit = rx.receiver._commit

    def commit(request):
      response = real_commit(request)
      commits.append(response.complete)
      return response

    with StateSender(rx.target, options=SenderOptions(plane="tcp", lanes=4)) as sender:
      send(sender, config, state)  # cold: gRPC Begin learns the plane
      rx.receiver.ready.get(timeout=10)
      rx.receiver._commit = commit
      for pool in sender.data_planes:
        for lane in pool.lanes():
          lane._fault_hook = hook
      send(sender, config, state)
      received = rx.receiver.ready.get(timeout=10)
    assert_clean(rx)
  return commits, writes, received


def test_commit_follows_the_bundle_on_its_connection(config, state, monkeypatch):
  """COMMIT does not wait for the BUNDLE's acknowledgement: it follows the
  BUNDLE on its connection, so even while that connection stalls before
  writing the BUNDLE, no other connection carries COMMIT ahead of it, and
  the receiver's first Commit finds the state complete."""
  commits, writes, received = _pipelined_commit_run(config, state, monkeypatch,
                                                    hold_bundle_s=0.3)
  assert commits == [True]
  lanes = {kind: lane for kind, _, lane in reversed(writes)}  # each kind's first write
  assert [kind for kind, _, _ in writes] == [frames.BEGIN, frames.BUNDLE, frames.COMMIT]
  assert lanes[frames.COMMIT] == lanes[frames.BUNDLE]
  assert_states_match(state, received.state, N)


def test_negative_control_unpinned_commit_overtakes_the_bundle(config, state, monkeypatch):
  """Negative control of the above: COMMIT free for any connection leaves on
  another one while the BUNDLE's stalls; the receiver answers incomplete
  first, and the sender's resend round still commits the whole state."""
  commits, writes, received = _pipelined_commit_run(config, state, monkeypatch,
                                                    hold_bundle_s=0.3, unpinned=True)
  assert commits[0] is False and commits[-1] is True
  lanes = {kind: lane for kind, _, lane in reversed(writes)}  # each kind's first write
  assert lanes[frames.COMMIT] != lanes[frames.BUNDLE]
  assert_states_match(state, received.state, N)


def test_commit_behind_a_rejected_bundle_gets_the_state_resent(config, state, monkeypatch):
  """A BUNDLE damaged on the wire is NACKed and resent whole. COMMIT (queued
  while the BUNDLE's write stalled) either left right behind the damaged one
  and found the state incomplete (then the sender resends what is missing
  and commits again) or, not yet taken when the NACK came back, followed the
  resent one; either way the whole state is committed."""
  commits, writes, received = _pipelined_commit_run(config, state, monkeypatch,
                                                    hold_bundle_s=0.3, corrupt_bundle=True)
  assert commits[-1] is True and commits.count(True) == 1
  kinds = [kind for kind, _, _ in writes]
  assert kinds.count(frames.COMMIT) == len(commits)
  assert any(kind == frames.BUNDLE and attempt > 0 for kind, attempt, _ in writes)
  assert_states_match(state, received.state, N)
