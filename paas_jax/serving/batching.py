"""Request-level batching around the engines.

* ``PrefillBatcher``: a thread that gathers queued prompts into batches for
  ``PrefillEngine`` (used by the PrfaaS prefill server and by PD-P prefill in
  the decode server).
* ``DecodeScheduler``: continuous batching over ``DecodeEngine``: admits
  requests whose state is ready into free slots between decode steps, streams
  each token to its request, frees slots as requests finish or are cancelled.
  A bounded wait queue stands in front of the pool; beyond it ``submit``
  raises ``QueueFullError`` (RESOURCE_EXHAUSTED on the wire). An accepted
  request always ends with a ``finished`` or an ``error`` event, never silently.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import grpc
import numpy as np

from paas_jax.serving.engine import (DecodeEngine, EngineError, InvalidRequestError,
                                     PrefillEngine, PrefillInput, PrefillOutput, RequestParams)
from paas_jax.state import DecodeState

log = logging.getLogger(__name__)


class QueueFullError(EngineError):
  """The decode pool and its wait queue are full."""


# -- prefill batching ------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class PrefillJob:
  """A prompt waiting for a prefill batch.

  Callbacks run on the batcher thread: ``on_start()`` right before the batch
  computes (may raise to drop the job, e.g. a refused transfer), ``on_layer(i,
  cache)`` for each layer of the last chunk (this request's rows only, numpy),
  ``on_chunk(i, cache, start, end, row)`` for each layer of **every** chunk as
  soon as it is computed (batched device cache, this request in ``row``, its
  tokens ``[start, end)``; ``chunk_stream.ChunkStreamer.put``), ``on_done(output)``
  or ``on_error(exc)`` once. ``resume = (n, state)``: continue the prompt from a
  committed batch-1 state of its first ``n`` tokens (``PrefillEngine.prefill``);
  such a job is prefilled on its own.
  """

  input: PrefillInput
  on_done: Callable[[PrefillOutput], None]
  on_error: Callable[[BaseException], None]
  on_start: Callable[[], None] | None = None
  on_layer: Callable[[int, object], None] | None = None
  on_chunk: Callable[[int, object, int, int, int], None] | None = None
  resume: tuple | None = None
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: bool = False
  started: float | None = None


class PrefillBatcher:
  """Gathers jobs for up to ``batch_window_s`` after the first one arrives."""

  def __init__(self, engine: PrefillEngine, batch_window_s: float = 0.005,
               name: str = "prefill"):
    self.engine = engine
    self.batch_window_s = batch_window_s
    self._queue: collections.deque[PrefillJob] = collections.deque()
    self._cv = threading.Condition()
    self._stop = False
    self.batches = 0
    self.prompts = 0
    self.tokens = 0
    self.busy_s = 0.0
    self._thread = threading.Thread(target=self._loop, name=f"{name}-batcher", daemon=True)
    self._thread.start()

  @property
  def queue_depth(self) -> int:
    with self._cv:
      return len(self._queue)

  def submit(self, job: PrefillJob) -> None:
    with self._cv:
      if self._stop:
        raise EngineError("prefill batcher stopped")
      self._queue.append(job)
      self._cv.notify_all()

  def drain(self) -> list[PrefillJob]:
    """Takes every job still waiting for a batch out of the queue (the batch
    running now goes on); the caller ends them (a preemption)."""
    with self._cv:
      pending = [j for j in self._queue if not j.cancelled]
      self._queue.clear()
    return pending

  def stop(self) -> None:
    with self._cv:
      self._stop = True
      pending = list(self._queue)
      self._queue.clear()
      self._cv.notify_all()
    for job in pending:
      job.on_error(EngineError("server shutting down"))
    self._thread.join(timeout=10)

  def _take_batch(self) -> list[PrefillJob]:
    max_batch = self.engine.config.prefill_max_batch
    with self._cv:
      while not self._queue and not self._stop:
        self._cv.wait()
      if self._stop:
        return []
      deadline = time.monotonic() + self.batch_window_s
      while len(self._queue) < max_batch and not self._stop:
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._cv.wait(left)
      batch = []
      while self._queue and len(batch) < max_batch:
        job = self._queue.popleft()
        if not job.cancelled:
          batch.append(job)
      return batch

  def _loop(self) -> None:
    while True:
      batch = self._take_batch()
      if not batch:
        with self._cv:
          if self._stop:
            return
        continue
      if getattr(self.engine, "prefix_cache", None) is not None:
        self._run_cached(batch)
        continue
      alone = [j for j in batch if j.resume is not None]
      if alone:
        self._run_cached(alone)
        batch = [j for j in batch if j.resume is None]
        if not batch:
          continue
      started = []
      for job in batch:
        try:
          if job.on_start is not None:
            job.on_start()
          started.append(job)
        except BaseException as e:  # pylint: disable=broad-except
          job.on_error(e)
      if not started:
        continue
      t0 = time.perf_counter()
      for job in started:
        job.started = t0
      try:
        outputs = self.engine.prefill([j.input for j in started],
                                      layer_sink=self._sink(started),
                                      chunk_sink=self._chunk_sink(started))
      except BaseException as e:  # pylint: disable=broad-except
        log.exception("prefill batch failed")
        for job in started:
          job.on_error(e)
        continue
      self.busy_s += time.perf_counter() - t0
      self.batches += 1
      self.prompts += len(started)
      self.tokens += sum(o.prompt_len for o in outputs)
      for job, out in zip(started, outputs):
        try:
          job.on_done(out)
        except BaseException:  # pylint: disable=broad-except
          log.exception("prefill on_done callback failed")

  def _run_cached(self, batch: list[PrefillJob]) -> None:
    """With a prefix cache the engine prefills one prompt at a time, so each job
    starts (``on_start``: e.g. opens its transfer) right before its own prefill.
    Resumed jobs run this way too."""
    for job in batch:
      if job.cancelled:
        continue
      try:
        if job.on_start is not None:
          job.on_start()
      except BaseException as e:  # pylint: disable=broad-except
        job.on_error(e)
        continue
      t0 = time.perf_counter()
      job.started = t0
      try:
        out = self.engine.prefill([job.input], layer_sink=self._sink([job]),
                                  chunk_sink=self._chunk_sink([job]), resume=job.resume)[0]
      except BaseException as e:  # pylint: disable=broad-except
        log.exception("cached prefill failed")
        job.on_error(e)
        continue
      self.busy_s += time.perf_counter() - t0
      self.batches += 1
      self.prompts += 1
      self.tokens += out.prompt_len
      try:
        job.on_done(out)
      except BaseException:  # pylint: disable=broad-except
        log.exception("prefill on_done callback failed")

  @staticmethod
  def _chunk_sink(jobs: list[PrefillJob]):
    if not any(j.on_chunk is not None for j in jobs):
      return None

    def sink(layer_idx, cache, start, n_valid):
      for row, job in enumerate(jobs):
        n = int(n_valid[row])
        if job.on_chunk is None or job.cancelled or n <= 0:
          continue
        try:
          job.on_chunk(layer_idx, cache, start, start + n, row)
        except BaseException as e:  # pylint: disable=broad-except
          # The job's stream failed; it reports the error itself at on_done.
          log.warning("chunk [%d, %d) layer %d of %s not streamed: %r", start, start + n,
                      layer_idx, job.input.request_id, e)
          job.on_chunk = None
    return sink

  @staticmethod
  def _sink(jobs: list[PrefillJob]):
    if not any(j.on_layer is not None for j in jobs):
      return None

    def sink(layer_idx, cache):
      import jax  # pylint: disable=g-import-not-at-top
      host = jax.tree_util.tree_map(np.asarray, cache)
      for row, job in enumerate(jobs):
        if job.on_layer is None or job.cancelled:
          continue
        try:
          job.on_layer(layer_idx, jax.tree_util.tree_map(lambda x, r=row: x[r:r + 1], host))
        except BaseException as e:  # pylint: disable=broad-except
          # The job's transfer failed; it reports the error itself at on_done.
          log.warning("layer %d of %s not sent: %r", layer_idx, job.input.request_id, e)
          job.on_layer = None
    return sink


# -- decode scheduling -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Event:
  """What the scheduler tells a request's stream.

  kind: "accepted" | "slot" | "tokens" | "finished" | "error".
  """

  kind: str
  tokens: tuple[int, ...] = ()
  reason: str = ""
  code: grpc.StatusCode | None = None
  info: dict = dataclasses.field(default_factory=dict)


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
  slot: int | None = None
  generated: int = 0
  done: bool = False
  cancelled: bool = False
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def total_tokens(self) -> int:
    return self.prompt_len + self.params.max_new_tokens

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

  def provide_first_token(self, request_id: str, token: int) -> bool:
    return self._provide(request_id, first_token=int(token), info={})

  def _provide(self, request_id: str, *, info: dict, state=None, first_token=None) -> bool:
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
        orphan.setdefault("info", {}).update(info)
        return True
      if state is not None:
        job.state = state
      if first_token is not None:
        job.first_token = first_token
      job.info.update(info)
      self._cv.notify_all()
      return True

  def prefilled(self, job: DecodeJob, output) -> None:
    """PD-P prefill finished for ``job``."""
    job.info.update(prefill_s=output.prefill_s, prefill_batch_size=output.batch_size,
                    prefill_cached_tokens=getattr(output, "cached_tokens", 0))
    self._provide(job.request_id, state=output.state, first_token=output.first_token,
                  info={})

  def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
    """Ends a request with an error (e.g. its transfer failed)."""
    with self._cv:
      job = self._jobs.get(request_id)
      if job is None:
        self._orphans.pop(request_id, None)
        return
      job.cancelled = True  # the loop frees its slot, if any
      self._cv.notify_all()
    job.events.put(Event("error", code=code, reason=message))
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
        job.events.put(Event("error", code=grpc.StatusCode.UNAVAILABLE,
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
          "tokens_generated": self.counters["tokens"],
          "accepted": self.counters["accepted"],
          "finished": self.counters["finished"],
          "cancelled": self.counters["cancelled"],
          "failed": self.counters["failed"],
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
    job.events.put(Event("finished", reason=reason))
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
      tokens = self.engine.generate()
      self.step_s_total += time.perf_counter() - t0
      self.counters["steps"] += 1
      self.busy_slot_steps += len(active)
      for slot, job in active.items():
        if job.cancelled or job.done:
          continue
        self._emit(job, slot, int(tokens[slot]))

  def _start(self, job: DecodeJob, slot: int) -> None:
    """Inserts a ready job into its reserved slot and emits its first token."""
    queue_s = time.perf_counter() - job.created
    first = int(job.first_token)
    try:
      needs_slot = not (job.params.max_new_tokens <= 1 or first in job.params.stop_tokens)
      if needs_slot:
        self.engine.insert(job.state, slot, first, job.params)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("insert of %s failed", job.request_id)
      self.engine.free(slot)
      with self._cv:
        self._forget(job)
      job.events.put(Event("error", code=grpc.StatusCode.INTERNAL,
                           reason=f"inserting the state into the decode pool failed: {e}"))
      self.counters["failed"] += 1
      return
    job.state = None  # the pool holds it now
    job.slot = slot
    job.generated = 1
    job.events.put(Event("slot", info={"slot": slot, "queue_s": queue_s, **job.info}))
    job.events.put(Event("tokens", tokens=(first,)))
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

  def _emit(self, job: DecodeJob, slot: int, token: int) -> None:
    job.generated += 1
    self.counters["tokens"] += 1
    job.events.put(Event("tokens", tokens=(token,)))
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
