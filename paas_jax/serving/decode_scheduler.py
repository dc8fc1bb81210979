"""Continuous batching over ``DecodeEngine``.

``DecodeScheduler`` admits requests whose state is ready into free slots
between decode steps, streams each token to its request, frees slots as
requests finish or are cancelled. A bounded wait queue stands in front of the
pool; beyond it ``submit`` raises ``QueueFullError`` (RESOURCE_EXHAUSTED on the
wire). An accepted request always ends with a ``finished`` or an ``error``
event, never silently.

First token early (``provide_first_token(..., early=True)``): a remote
request's first token was sampled by the prefill side from its own state, so
it is streamed as soon as it is handed over, before the state lands; the
request then takes a slot, and token 2 onwards, only once the state arrived
(through the handoff probe check). If the state never passes, the request ends
with an error after token 1 and no token 2 is ever streamed.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import queue
import threading
import time
from typing import Callable

import grpc

from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.validation import EngineError, InvalidRequestError, RequestParams
from paas_jax.state import DecodeState

log = logging.getLogger(__name__)


class QueueFullError(EngineError):
  """The decode pool and its wait queue are full."""


class EventKind(enum.StrEnum):
  """What an ``Event`` tells a request's stream."""

  SLOT = "slot"          # state restored into a slot (``info``: slot, queue/prefill times)
  TOKENS = "tokens"      # ``tokens`` (and their ``logprobs``) were sampled
  FINISHED = "finished"  # ended normally (``reason``: stop_token, max_tokens, ...)
  ERROR = "error"        # ended with gRPC status ``code`` (``reason``: the message)


@dataclasses.dataclass(frozen=True)
class Event:
  """What the scheduler tells a request's stream. ``logprobs``: one
  ``TokenLogprob`` per token when the request asked for them, else empty."""

  kind: EventKind
  tokens: tuple[int, ...] = ()
  logprobs: tuple = ()
  reason: str = ""
  code: grpc.StatusCode | None = None
  info: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "kind", EventKind(self.kind))  # a misspelt kind raises


@dataclasses.dataclass(eq=False)
class DecodeJob:
  """A request of the decode pool."""

  request_id: str
  params: RequestParams
  prompt_len: int
  remote: bool
  prompt: tuple[int, ...] | None = None
  events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
  created: float = dataclasses.field(default_factory=time.perf_counter)
  state: DecodeState | None = None
  first_token: int | None = None
  first_logprob: object | None = None  # logprobs.TokenLogprob of first_token
  first_sent: bool = False  # the first token was streamed early (before the state)
  slot: int | None = None
  generated: int = 0
  done: bool = False
  cancelled: bool = False
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def total_tokens(self) -> int:
    return self.prompt_len + self.params.max_new_tokens

  @property
  def first_logprob_ok(self) -> bool:
    """The first token carries the logprobs the request asked for (if any)."""
    want = self.params.logprobs
    return want < 0 or (self.first_logprob is not None
                        and len(self.first_logprob.top_ids) == want)

  @property
  def ready(self) -> bool:
    return self.state is not None and self.first_token is not None


class DecodeScheduler:
  """Continuous batching over a ``DecodeEngine`` (the only thread touching it).

  Args:
    engine: the decode pool.
    max_queue: requests allowed to wait once every slot is taken: at most
      ``n_slots + max_queue`` requests are registered at a time.
    orphan_ttl_s: how long a state or first token that arrived before its
      request was registered is kept.
    on_local_prefill: called with a local (PD-P) job to prefill; the callee
      calls ``prefilled`` or ``fail`` later.
  """

  def __init__(self, engine: DecodeEngine, *, max_queue: int = 64,
               orphan_ttl_s: float = 120.0,
               on_local_prefill: Callable[[DecodeJob], None] | None = None):
    self.engine = engine
    self.max_queue = max_queue
    self.orphan_ttl_s = orphan_ttl_s
    self.on_local_prefill = on_local_prefill
    self._cv = threading.Condition()
    self._jobs: dict[str, DecodeJob] = {}
    self._waiting: list[DecodeJob] = []       # registered, no slot yet (FIFO)
    self._active: dict[int, DecodeJob] = {}   # slot -> job
    self._orphans: dict[str, dict] = {}       # request id -> {"state", "first_token", "t"}
    self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
    self._stop = False
    self.counters = collections.Counter()
    self.step_s_total = 0.0
    self.busy_slot_steps = 0
    self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
    self._thread.start()

  # -- inputs (any thread) --------------------------------------------------------

  def submit(self, job: DecodeJob) -> int:
    """Registers a request; returns its queue position. Raises ``QueueFullError``."""
    if not self.engine.fits_ever(job.total_tokens):
      raise InvalidRequestError(
          f"prompt ({job.prompt_len}) + max_new_tokens ({job.params.max_new_tokens}) does "
          f"not fit a decode slot of {self.engine.max_ctx} tokens")
    with self._cv:
      if self._stop:
        raise EngineError("decode server shutting down")
      if job.request_id in self._jobs:
        raise InvalidRequestError(f"request id {job.request_id!r} is already in use")
      # Capacity = every slot busy plus max_queue requests waiting behind them.
      if len(self._waiting) + len(self._active) >= self.engine.n_slots + self.max_queue:
        self.counters["rejected_queue_full"] += 1
        raise QueueFullError(
            f"decode pool full: {len(self._active)} of {self.engine.n_slots} slots busy and "
            f"{len(self._waiting)} requests waiting (queue limit {self.max_queue})")
      self._jobs[job.request_id] = job
      self._waiting.append(job)
      self._gone.pop(job.request_id, None)
      orphan = self._orphans.pop(job.request_id, None)
      if orphan is not None:
        job.state = orphan.get("state", job.state)
        if orphan.get("first_token") is not None:
          job.first_token = orphan["first_token"]
          job.first_logprob = orphan.get("first_logprob")
        job.info.update(orphan.get("info", {}))
      self.counters["accepted"] += 1
      position = len(self._waiting) - 1
      self._cv.notify_all()
    if not job.remote and self.on_local_prefill is not None:
      self.on_local_prefill(job)
    return position

  def provide_state(self, request_id: str, state: DecodeState, info: dict | None = None) -> bool:
    """A transferred state arrived; False if its request is gone (the state is dropped)."""
    return self._provide(request_id, state=state, info=info or {})

  def provide_first_token(self, request_id: str, token: int, logprob=None,
                          early: bool = False) -> bool:
    """The first token (and its ``TokenLogprob`` when the request asked) arrived.
    ``early``: stream it now (module docstring) if the request is registered and
    it was not sent yet."""
    return self._provide(request_id, first_token=int(token), info={}, first_logprob=logprob,
                         early=early)

  def wanted_logprobs(self, request_id: str) -> int | None:
    """The registered request's ``RequestParams.logprobs``; None if not registered."""
    with self._cv:
      job = self._jobs.get(request_id)
      return None if job is None else job.params.logprobs

  def _provide(self, request_id: str, *, info: dict, state=None, first_token=None,
               first_logprob=None, early: bool = False) -> bool:
    with self._cv:
      if request_id in self._gone:
        return False
      job = self._jobs.get(request_id)
      if job is None:
        orphan = self._orphans.setdefault(request_id, {"t": time.monotonic()})
        if state is not None:
          orphan["state"] = state
        if first_token is not None:
          orphan["first_token"] = first_token
          orphan["first_logprob"] = first_logprob
        orphan.setdefault("info", {}).update(info)
        return True
      if state is not None:
        job.state = state
      if first_token is not None:
        job.first_token = first_token
        job.first_logprob = first_logprob
        if (early and job.remote and not job.first_sent and job.slot is None
            and job.first_logprob_ok):  # else _start fails the request
          job.first_sent = True
          job.events.put(Event(EventKind.TOKENS, tokens=(first_token,), logprobs=(
              (first_logprob,) if job.params.logprobs >= 0 else ())))
          self.counters["tokens"] += 1
          self.counters["first_tokens_early"] += 1
      job.info.update(info)
      self._cv.notify_all()
      return True

  def prefilled(self, job: DecodeJob, output) -> None:
    """PD-P prefill finished for ``job``."""
    job.info.update(prefill_s=output.prefill_s, prefill_batch_size=output.batch_size,
                    prefill_cached_tokens=getattr(output, "cached_tokens", 0))
    self._provide(job.request_id, state=output.state, first_token=output.first_token,
                  info={}, first_logprob=getattr(output, "first_logprob", None))

  def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
    """Ends a request with an error (e.g. its transfer failed)."""
    with self._cv:
      job = self._jobs.get(request_id)
      if job is None:
        self._orphans.pop(request_id, None)
        return
      job.cancelled = True  # the loop frees its slot, if any
      self._cv.notify_all()
    job.events.put(Event(EventKind.ERROR, code=code, reason=message))
    self.counters["failed"] += 1

  def cancel(self, request_id: str) -> None:
    """The client went away: drop the request and free its slot."""
    with self._cv:
      job = self._jobs.get(request_id)
      self._orphans.pop(request_id, None)
      self._remember_gone(request_id)
      if job is None or job.done:
        return
      job.cancelled = True
      self.counters["cancelled"] += 1
      if job in self._waiting:  # not in a slot yet: gone at once
        self._waiting.remove(job)
        self._forget(job)
      self._cv.notify_all()

  def stop(self) -> None:
    with self._cv:
      self._stop = True
      jobs = list(self._jobs.values())
      self._cv.notify_all()
    self._thread.join(timeout=10)
    for job in jobs:
      if not job.done:
        job.events.put(Event(EventKind.ERROR, code=grpc.StatusCode.UNAVAILABLE,
                             reason="decode server shutting down"))

  # -- introspection --------------------------------------------------------------

  def stats(self) -> dict:
    with self._cv:
      return {
          "slots_total": self.engine.n_slots,
          "slots_busy": len(self._active),
          "slots_free": self.engine.free_slots,
          "pages_total": self.engine.num_pages,
          "pages_free": self.engine.free_pages,
          "waiting": len(self._waiting),
          "waiting_ready": sum(1 for j in self._waiting if j.ready),
          "orphans": len(self._orphans),
          "max_queue": self.max_queue,
          "steps": self.counters["steps"],
          "device_calls": self.counters["device_calls"],
          "tokens_generated": self.counters["tokens"],
          "accepted": self.counters["accepted"],
          "finished": self.counters["finished"],
          "cancelled": self.counters["cancelled"],
          "failed": self.counters["failed"],
          "first_tokens_early": self.counters["first_tokens_early"],
          "rejected_queue_full": self.counters["rejected_queue_full"],
          "mean_step_ms": 1e3 * self.step_s_total / max(self.counters["steps"], 1),
          "mean_batch": self.busy_slot_steps / max(self.counters["steps"], 1),
      }

  # -- the loop -------------------------------------------------------------------

  def _remember_gone(self, request_id: str) -> None:
    self._gone[request_id] = None
    while len(self._gone) > 4096:
      self._gone.popitem(last=False)

  def _finish(self, job: DecodeJob, reason: str) -> None:
    job.done = True
    job.events.put(Event(EventKind.FINISHED, reason=reason))
    self.counters["finished"] += 1

  def _forget(self, job: DecodeJob) -> None:
    # Caller holds the lock.
    self._jobs.pop(job.request_id, None)
    self._remember_gone(job.request_id)

  def _admit(self) -> list[tuple[DecodeJob, int]]:
    """Picks ready jobs that fit (FIFO, first fit); reserves their slots. Holds the lock."""
    admitted = []
    keep = []
    for job in self._waiting:
      if job.cancelled:
        self._forget(job)
        continue
      if job.ready and not admitted_blocked(self.engine, job):
        slot = self.engine.reserve(job.total_tokens)
        admitted.append((job, slot))
      else:
        keep.append(job)
    self._waiting = keep
    return admitted

  def _gc_orphans(self) -> None:
    now = time.monotonic()
    for rid in [r for r, o in self._orphans.items() if now - o["t"] > self.orphan_ttl_s]:
      del self._orphans[rid]
      self.counters["orphans_dropped"] += 1

  def _loop(self) -> None:
    last_gc = time.monotonic()
    while True:
      with self._cv:
        if self._stop:
          return
        # Slots of cancelled or failed requests go back first.
        for slot, job in list(self._active.items()):
          if job.cancelled:
            del self._active[slot]
            self.engine.free(slot)
            self._forget(job)
        admitted = self._admit()
        if not admitted and not self._active:
          if time.monotonic() - last_gc > 1.0:
            self._gc_orphans()
            last_gc = time.monotonic()
          self._cv.wait(0.25)
          continue
      for job, slot in admitted:
        self._start(job, slot)
      with self._cv:
        active = dict(self._active)
      if not active:
        continue
      t0 = time.perf_counter()
      steps = self._window(active)
      if steps > 1:
        rows, logprobs = self.engine.generate_steps(steps), {}
      else:
        rows = self.engine.generate()[None]
        # Log-probabilities only for the slots that asked (no work otherwise).
        logprobs = self.engine.step_logprobs(
            {slot: job.params.logprobs for slot, job in active.items()
             if job.params.logprobs >= 0 and not (job.cancelled or job.done)})
      self.step_s_total += time.perf_counter() - t0
      self.counters["steps"] += steps
      self.counters["device_calls"] += 1
      self.busy_slot_steps += steps * len(active)
      for tokens in rows:
        for slot, job in active.items():
          if job.cancelled or job.done:
            continue  # tokens a window sampled past a request's end are dropped
          self._emit(job, slot, int(tokens[slot]), logprobs.get(slot))

  def _window(self, active: dict[int, DecodeJob]) -> int:
    """Decode steps of the next device call: ``decode_steps_per_sync`` bounded by
    the tokens every active request may still produce, rounded down to a power
    of two; 1 while a ready request waits for a free slot (it is admitted
    between calls) or an active request asks for logprobs."""
    cap = self.engine.config.decode_steps_per_sync
    if cap <= 1:
      return 1
    live = [j for j in active.values() if not (j.cancelled or j.done)]
    if not live or any(j.params.logprobs >= 0 for j in live):
      return 1
    with self._cv:
      if self.engine.free_slots and any(j.ready and not j.cancelled for j in self._waiting):
        return 1
    room = min(cap, *(j.params.max_new_tokens - j.generated for j in live))
    return 1 << (max(room, 1).bit_length() - 1)

  def _start(self, job: DecodeJob, slot: int) -> None:
    """Inserts a ready job into its reserved slot and emits its first token."""
    queue_s = time.perf_counter() - job.created
    first = int(job.first_token)
    try:
      if not job.first_logprob_ok:
        raise EngineError("the first token arrived without the logprobs the request asked "
                          f"for (top {job.params.logprobs})")
      needs_slot = not (job.params.max_new_tokens <= 1 or first in job.params.stop_tokens)
      if needs_slot:
        self.engine.insert(job.state, slot, first, job.params)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("insert of %s failed", job.request_id)
      self.engine.free(slot)
      with self._cv:
        self._forget(job)
      job.events.put(Event(EventKind.ERROR, code=grpc.StatusCode.INTERNAL,
                           reason=f"inserting the state into the decode pool failed: {e}"))
      self.counters["failed"] += 1
      return
    job.state = None  # the pool holds it now
    job.slot = slot
    job.generated = 1
    job.events.put(Event(EventKind.SLOT, info={"slot": slot, "queue_s": queue_s, **job.info}))
    if not job.first_sent:  # else streamed already, at the handoff
      job.events.put(Event(EventKind.TOKENS, tokens=(first,), logprobs=(
          (job.first_logprob,) if job.params.logprobs >= 0 else ())))
      self.counters["tokens"] += 1
    if not needs_slot:
      self.engine.free(slot)
      with self._cv:
        self._forget(job)
      self._finish(job, "stop_token" if first in job.params.stop_tokens else "max_tokens")
      return
    with self._cv:
      if job.cancelled:
        self.engine.free(slot)
        self._forget(job)
        return
      self._active[slot] = job

  def _emit(self, job: DecodeJob, slot: int, token: int, logprob=None) -> None:
    job.generated += 1
    self.counters["tokens"] += 1
    job.events.put(Event(EventKind.TOKENS, tokens=(token,),
                         logprobs=(logprob,) if logprob is not None else ()))
    reason = None
    if token in job.params.stop_tokens:
      reason = "stop_token"
    elif job.generated >= job.params.max_new_tokens:
      reason = "max_tokens"
    if reason is not None:
      with self._cv:
        self._active.pop(slot, None)
        self.engine.free(slot)
        self._forget(job)
      self._finish(job, reason)


def admitted_blocked(engine: DecodeEngine, job: DecodeJob) -> bool:
  """True if the pool cannot take ``job`` right now."""
  return not engine.can_admit(job.total_tokens)
