"""The slice leader on its own (``slice_leader``; no JAX program, no servers):
a fake batch runs the rounds as every slice process would report them, so
that these tests see what the leader decides: which requests join which
rows and when, when a remote request is admissible (every process holds its
parts), how failures, lateness, cancellations and a lost slice reach the
clients. Each check has its failing case beside it."""

from __future__ import annotations

import queue
import threading
import time
import types

from paas_jax.serving import pod
from paas_jax.serving.slice_batch import ReadyBoard
from paas_jax.serving.slice_decode import SliceJob, SliceParts
from paas_jax.serving.slice_leader import SliceLeader, SliceRequest
from paas_jax.serving.validation import RequestParams


class _Batch:
  """Rows and rounds as a slice process keeps them; every row emits token 7
  per step and finishes at its ``max_new_tokens``."""

  def __init__(self, *, processes=1, slots=2, outcome="ok", hold_s=0.0):
    self.region = pod.RegionSpec("", processes, 0, 1, 5.0)
    self.parts = SliceParts(0)
    self.rows = [None] * slots
    self.outcome = outcome
    self.rounds = []
    self.hold_s = hold_s  # each round takes this long (a slow or stuck collective)
    self.release = threading.Event()

  @property
  def slots(self):
    return len(self.rows)

  def active(self):
    return sum(r is not None for r in self.rows)

  def run_round(self, rnd, emit):
    self.rounds.append(rnd)
    self.release.wait(self.hold_s)
    if self.outcome == "raise":
      raise RuntimeError("lost a collective")
    report = {"process": 0, "ok": True, "failed": {}, "finished": {}, "wire_bytes": {},
              "steps": 0, "row_steps": 0, "probes": 0}
    for rid in rnd.evict:
      self.rows = [None if r and r.job.request_id == rid else r for r in self.rows]
    for slot, job in rnd.admit:
      assert self.rows[slot] is None, "admitted into a busy row"
      if self.outcome == "refused":  # its state was probed, and failed
        report["probes"] += 1
        report["failed"][job.request_id] = {"code": "DATA_LOSS", "probe_mismatch": True,
                                            "error": "the received state failed the probe"}
        continue
      report["wire_bytes"][job.request_id] = 10
      self.rows[slot] = types.SimpleNamespace(job=job, tokens=[job.first_token])
    report["max_rows"] = self.active()
    for _ in range(rnd.steps):
      if not self.active():
        break
      report["steps"] += 1
      for i, row in enumerate(self.rows):
        if row is None:
          continue
        report["row_steps"] += 1
        row.tokens.append(7)
        emit(row.job.request_id, "token", 7, None)
        if len(row.tokens) >= row.job.max_new_tokens:
          emit(row.job.request_id, "finished", "max_tokens")
          report["finished"][row.job.request_id] = {"tokens": row.tokens,
                                                    "reason": "max_tokens"}
          self.rows[i] = None
    return report


def _request(rid, *, max_new=3, remote=False):
  params = RequestParams(max_new_tokens=max_new)
  return SliceRequest(rid, lambda n: SliceJob.from_request(n, rid, 3, params, first_token=1),
                      queue.Queue(), threading.Event(), 0.0, params=params, prompt_len=3,
                      remote=remote)


def _events(request, n):
  return [request.events.get(timeout=60) for _ in range(n)]


def _until_idle(leader):
  deadline = time.monotonic() + 60
  while (leader.busy or leader.queue_depth) and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not (leader.busy or leader.queue_depth), "the leader never went idle"


def test_requests_share_the_rows_and_a_waiting_one_takes_the_first_freed():
  batch = _Batch(slots=2)
  leader = SliceLeader(batch, ReadyBoard(), steps_per_round=4)
  first, second, third = _request("a", max_new=3), _request("b", max_new=5), _request("c")
  for r in (first, second, third):
    leader.submit(r)
  assert _events(first, 3) == [("token", 7, None)] * 2 + [("finished", "max_tokens")]
  assert _events(third, 3)[-1] == ("finished", "max_tokens")
  assert _events(second, 5)[-1] == ("finished", "max_tokens")
  _until_idle(leader)
  admitted = [(slot, job.request_id) for rnd in batch.rounds for slot, job in rnd.admit]
  assert admitted == [(0, "a"), (1, "b"), (0, "c")]  # c waits for a's row
  # While c waited, rounds were one step long, so that it joined within a step.
  assert all(rnd.steps == 1 for rnd in batch.rounds if rnd.number < 3)
  assert leader.counters["jobs_done"] == 3 and leader.counters["max_batch"] == 2
  assert leader.counters["row_steps"] > leader.counters["steps"]
  assert leader.counters["slice_bytes_in:0"] == 30


def test_the_leader_skips_cancelled_requests_evicts_gone_ones_and_reports_refusals():
  batch = _Batch(slots=1)
  leader = SliceLeader(batch, ReadyBoard(), steps_per_round=1)
  skipped, long_, after = _request("a"), _request("b", max_new=1000), _request("c")
  skipped.cancelled.set()
  leader.submit(skipped)
  leader.submit(long_)
  _events(long_, 2)
  leader.cancel(long_)  # its client went away mid-decode
  leader.submit(after)
  assert _events(after, 3)[-1] == ("finished", "max_tokens")
  _until_idle(leader)
  assert skipped.events.empty() and skipped.number == 0
  assert any("b" in rnd.evict for rnd in batch.rounds)
  assert leader.counters["jobs_cancelled"] == 1 and leader.counters["jobs_skipped"] == 1
  refused = SliceLeader(_Batch(outcome="refused"), ReadyBoard())
  r = _request("d")
  refused.submit(r)
  assert _events(r, 1)[0][:2] == ("error", "DATA_LOSS")
  assert refused.counters["handoff_probe_mismatch"] == 1 and not refused.broken
  assert refused.counters["handoff_probe_ok"] == 0


def test_a_lost_round_breaks_the_slice_and_fails_what_it_holds():
  broken = threading.Event()
  lost = SliceLeader(_Batch(outcome="raise"), ReadyBoard(), on_broken=broken.set)
  first, second = _request("d"), _request("e")
  lost.submit(first)
  assert _events(first, 1)[0][:2] == ("error", "UNAVAILABLE") and broken.is_set()
  lost.submit(second)
  kind, code, message = _events(second, 1)[0]
  assert (kind, code) == ("error", "UNAVAILABLE") and "restarting" in message
  assert len(lost.batch.rounds) == 1 and second.number == 0  # no job number without a round


def test_a_remote_request_joins_only_once_every_process_holds_its_parts():
  batch = _Batch(processes=2)
  board = ReadyBoard()
  leader = SliceLeader(batch, board)
  request = _request("r", remote=True)
  board.post("r", 0, {"ok": True})
  leader.submit(request)
  time.sleep(0.3)
  assert batch.rounds == [] and request.events.empty()  # process 1 has not got its parts
  board.post("r", 1, {"ok": True})
  assert _events(request, 3)[-1] == ("finished", "max_tokens")


def test_a_remote_request_whose_parts_failed_or_are_late_fails_and_its_parts_go():
  batch = _Batch(processes=2)
  board = ReadyBoard()
  leader = SliceLeader(batch, board, receive_timeout_s=0.3)
  failed, late = _request("f", remote=True), _request("l", remote=True)
  board.post("f", 0, {"ok": True})
  board.post("f", 1, {"ok": False, "code": "DATA_LOSS", "error": "crc mismatch at layer 3"})
  board.post("l", 1, {"ok": True})
  leader.submit(failed)
  leader.submit(late)
  assert _events(failed, 1)[0] == ("error", "DATA_LOSS", "crc mismatch at layer 3")
  kind, code, message = _events(late, 1)[0]
  assert (kind, code) == ("error", "DEADLINE_EXCEEDED") and "processes [0]" in message
  _until_idle(leader)
  time.sleep(0.1)
  dropped = {rid for rnd in batch.rounds for rid in rnd.drop}
  assert dropped == {"f", "l"} and not any(rnd.admit for rnd in batch.rounds)


def test_a_request_gone_before_its_handoff_has_its_parts_dropped_everywhere():
  batch = _Batch()
  leader = SliceLeader(batch, ReadyBoard())
  request = _request("x", remote=True)
  leader.cancel(request)  # the RPC ended while region A was still prefilling
  deadline = time.monotonic() + 10
  while not batch.rounds and time.monotonic() < deadline:
    time.sleep(0.01)
  assert batch.rounds[0].drop == ("x",) and not batch.rounds[0].admit


def test_a_round_stuck_past_its_deadline_fails_its_requests_and_breaks_the_slice():
  broken = threading.Event()
  batch = _Batch(hold_s=60)  # process 0's part never comes back (until released)
  leader = SliceLeader(batch, ReadyBoard(), round_timeout_s=0.3, on_broken=broken.set)
  request = _request("s")
  leader.submit(request)
  kind, code, message = _events(request, 1)[0]
  assert (kind, code) == ("error", "UNAVAILABLE") and "did not finish within" in message
  assert broken.is_set() and leader.broken and leader.counters["jobs_failed"] == 1
  # The stuck round returning late changes nothing: its reports are not taken.
  batch.release.set()
  time.sleep(0.2)
  assert leader.counters["jobs_done"] == 0 and request.events.empty()


def test_a_slow_round_within_its_deadline_finishes_normally():
  """Negative control: the same fake held for less than the deadline."""
  broken = threading.Event()
  leader = SliceLeader(_Batch(hold_s=0.2), ReadyBoard(), round_timeout_s=5.0,
                       on_broken=broken.set)
  request = _request("t", max_new=2)
  leader.submit(request)
  assert _events(request, 2)[-1] == ("finished", "max_tokens")
  assert not broken.is_set() and leader.counters["jobs_done"] == 1

