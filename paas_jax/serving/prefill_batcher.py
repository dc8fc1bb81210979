"""Request-level batching in front of ``PrefillEngine``.

``PrefillBatcher``: a thread that gathers queued prompts (``PrefillJob``) into
batches for ``PrefillEngine`` (used by the PrfaaS prefill server and by PD-P
prefill in the decode server), with per-job callbacks for each computed layer
or chunk (the state transfer) and for the result. With a ``TenantPolicy`` the
waiting prompts of several tenants (the decode regions a shared region-A pool
serves) are taken by weighted fair queueing over prompt tokens, within
per-tenant quotas (``scheduling.tenant_queue``); without one, in arrival order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from paas_jax.codec.encode import spans_devices, wire_arrays
from paas_jax.scheduling.tenant_queue import DEFAULT_TENANT, TenantPolicy, TenantQueue
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput, PrefillOutput
from paas_jax.serving.validation import EngineError

log = logging.getLogger(__name__)


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
  such a job is prefilled on its own. ``tenant``: who asked (a decode region),
  for fair sharing.
  """

  input: PrefillInput
  on_done: Callable[[PrefillOutput], None]
  on_error: Callable[[BaseException], None]
  on_start: Callable[[], None] | None = None
  on_layer: Callable[[int, object], None] | None = None
  on_chunk: Callable[[int, object, int, int, int], None] | None = None
  resume: tuple | None = None
  tenant: str = DEFAULT_TENANT
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: bool = False
  started: float | None = None


class PrefillBatcher:
  """Gathers jobs for up to ``batch_window_s`` after the first one arrives;
  ``tenants`` (None: one FIFO) shares the batches between tenants."""

  def __init__(self, engine: PrefillEngine, batch_window_s: float = 0.005,
               name: str = "prefill", tenants: TenantPolicy | None = None):
    self.engine = engine
    self.batch_window_s = batch_window_s
    self._queue: TenantQueue[PrefillJob] = TenantQueue(
        tenants or TenantPolicy(fair=False), tenant_of=lambda job: job.tenant,
        cost_of=lambda job: len(job.input.prompt))
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

  def tenant_depths(self) -> dict[str, int]:
    with self._cv:
      return self._queue.depths()

  def tenant_served_tokens(self) -> dict[str, float]:
    """Prompt tokens handed to the engine per tenant so far."""
    with self._cv:
      return dict(self._queue.served_cost)

  def admits(self, tenant: str) -> bool:
    """False: ``tenant`` has its quota of prompts waiting already."""
    with self._cv:
      return self._queue.admits(tenant)

  def submit(self, job: PrefillJob) -> None:
    with self._cv:
      if self._stop:
        raise EngineError("prefill batcher stopped")
      self._queue.push(job)
      self._cv.notify_all()

  def drain(self) -> list[PrefillJob]:
    """Takes every job still waiting for a batch out of the queue (the batch
    running now goes on); the caller ends them (a preemption)."""
    with self._cv:
      pending = [j for j in self._queue.drain() if not j.cancelled]
    return pending

  def stop(self) -> None:
    with self._cv:
      self._stop = True
      pending = self._queue.drain()
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
      while len(self._queue) and len(batch) < max_batch:
        job = self._queue.pop()
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
      # One host copy of the batch; leaves spread over devices (tensor
      # parallelism) stay there and are encoded shard by shard (no gather).
      host = jax.tree_util.tree_map(lambda x: x if spans_devices(x) else np.asarray(x), cache)
      for row, job in enumerate(jobs):
        if job.on_layer is None or job.cancelled:
          continue
        try:
          job.on_layer(layer_idx, wire_arrays(
              jax.tree_util.tree_map(lambda x, r=row: x[r:r + 1], host)))
        except BaseException as e:  # pylint: disable=broad-except
          # The job's transfer failed; it reports the error itself at on_done.
          log.warning("layer %d of %s not sent: %r", layer_idx, job.input.request_id, e)
          job.on_layer = None
    return sink
