"""Order of a Decode stream's events when the stream falls behind the scheduler.

The broker's request lifecycle needs a request's slot before its finish
(WAITING_FOR_STATE -> DECODING -> FINISHED). With the first token streamed early
(at the Handoff), the queue reads: first token, slot, tokens, finish. A stream
that wakes only once all of them are queued (a loaded host) coalesces the
tokens; the slot that stopped the first message must still come out before
them. The slow suite caught the earlier form, which put the slot back at the
end of the queue, as ``waiting_for_state -> finished is not allowed``.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from paas_jax.serving.decode_scheduler import DecodeJob, Event, EventKind
from paas_jax.serving.decode_server import stream_events
from paas_jax.serving.slice_decode_server import stream_slice_events
from paas_jax.serving.slice_leader import SliceRequest
from paas_jax.serving.validation import RequestParams


class Aborted(Exception):
  pass


class FakeContext:
  """Only what the stream asks of a gRPC context; ``abort`` raises, as grpc's does."""

  def is_active(self) -> bool:
    return True

  def abort(self, code, details):
    raise Aborted(code, details)


def _summary(messages) -> list[tuple]:
  """Each message as ("slot",) or ("tokens", ids, finished); a message with
  neither tokens nor a finish is a slot event, as the broker reads it."""
  return [("tokens", list(m.token_ids), m.finished) if m.token_ids or m.finished
          else ("slot",) for m in messages]


def _job() -> DecodeJob:
  return DecodeJob("r1", RequestParams(max_new_tokens=4), prompt_len=8, remote=True)


def test_a_slot_queued_behind_the_early_first_token_comes_before_the_finish():
  job = _job()
  for ev in (Event(EventKind.TOKENS, tokens=(7,)), Event(EventKind.SLOT, info={"slot": 3}),
             Event(EventKind.TOKENS, tokens=(8,)), Event(EventKind.TOKENS, tokens=(9,)),
             Event(EventKind.FINISHED, reason="max_tokens")):
    job.events.put(ev)
  got = _summary(stream_events(job, FakeContext()))
  assert got == [("tokens", [7], False), ("slot",), ("tokens", [8, 9], True)]


def test_an_error_queued_behind_tokens_aborts_before_later_tokens():
  job = _job()
  for ev in (Event(EventKind.TOKENS, tokens=(7,)),
             Event(EventKind.ERROR, code=grpc.StatusCode.DATA_LOSS, reason="bad state"),
             Event(EventKind.TOKENS, tokens=(8,))):
    job.events.put(ev)
  out = []
  with pytest.raises(Aborted) as err:
    for m in stream_events(job, FakeContext()):
      out.append(m)
  assert _summary(out) == [("tokens", [7], False)]
  assert err.value.args == (grpc.StatusCode.DATA_LOSS, "bad state")


def test_events_queued_while_the_stream_waits_keep_their_order():
  job = _job()
  got = []
  reader = threading.Thread(target=lambda: got.extend(stream_events(job, FakeContext())))
  reader.start()
  job.events.put(Event(EventKind.SLOT, info={"slot": 0}))
  time.sleep(0.05)
  for t in (5, 6):
    job.events.put(Event(EventKind.TOKENS, tokens=(t,)))
  job.events.put(Event(EventKind.FINISHED, reason="max_tokens"))
  reader.join(10)
  assert not reader.is_alive()
  assert [("slot",)] == _summary(got)[:1]
  assert [t for m in got for t in m.token_ids] == [5, 6] and got[-1].finished


def test_a_slice_stream_keeps_the_slot_before_the_finish():
  entry = SliceRequest("r1", None, queue.Queue(), threading.Event(), time.perf_counter(),
                       remote=True)
  for ev in (("token", 7, None), ("slot", {}), ("token", 8, None), ("token", 9, None),
             ("finished", "max_tokens")):
    entry.events.put(ev)
  counters = {"failed": 0}
  got = _summary(stream_slice_events(entry, FakeContext(), counters))
  assert got == [("tokens", [7], False), ("slot",), ("tokens", [8, 9], True)]
  assert counters["failed"] == 0
