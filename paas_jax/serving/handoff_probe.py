"""The logit probe at the PrfaaS -> PD handoff (fail closed).

Prefill side (``make``): after prefill, one plain decode step from the state
it sends, fed the first token, fingerprinted (``paas_jax.state.logit_probe``)
into ``FirstToken.probe``; the broker forwards it in ``Handoff``.

Decode side (``HandoffVerifier``): a remote request's state (from the transfer
port) is held until its Handoff arrived; if the Handoff carries a probe, the
same step is run from the received state and compared, off the decode loop,
before the scheduler sees the state. So no token of the request is streamed
from a state that fails: the request fails with DATA_LOSS (the broker
re-prefills it locally), the event is logged with the request id and counted
(``paas_handoff_probes{outcome}``, GetStats ``handoff_probe_*``).

A Handoff without a probe (probes disabled on the prefill side) lets the state
through unchecked, counted as ``unverified``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent import futures
from typing import Callable

import grpc

from paas_jax.proto import serving_pb2
from paas_jax.state import logit_probe, sensitivity

log = logging.getLogger("paas_jax.serving.handoff_probe")

OUTCOMES = ("ok", "mismatch", "unverified", "error")
# A state or Handoff whose partner never came (the request was cancelled).
PENDING_TTL_S = 120.0


def to_proto(probe: logit_probe.LogitProbe) -> serving_pb2.LogitProbe:
  return serving_pb2.LogitProbe(token=probe.token, ids=list(probe.ids),
                                values=list(probe.values), dtype=probe.dtype)


def from_proto(msg: serving_pb2.LogitProbe) -> logit_probe.LogitProbe:
  """Raises ValueError for a malformed probe."""
  return logit_probe.LogitProbe(token=int(msg.token), ids=tuple(int(i) for i in msg.ids),
                                values=tuple(float(v) for v in msg.values),
                                dtype=msg.dtype or "float32")


def handoff_probe_of(request: serving_pb2.HandoffRequest, vocab_size: int
                     ) -> logit_probe.LogitProbe | None:
  """A ``HandoffRequest``'s checked ids and probe (None: unverified).

  Raises:
    ValueError: no request id, a first token outside the vocabulary, a
      malformed probe, or one for another token (the message says which).
  """
  if not request.request_id:
    raise ValueError("request_id is required")
  if not 0 <= request.first_token < vocab_size:
    raise ValueError(f"first_token {request.first_token} outside the vocabulary")
  if not request.HasField("probe"):
    return None
  try:
    probe = from_proto(request.probe)
  except ValueError as e:
    raise ValueError(f"probe: {e}") from None
  if probe.token != request.first_token:
    raise ValueError(f"probe.token {probe.token} is not first_token {request.first_token}")
  return probe


def make(model, output) -> serving_pb2.LogitProbe:
  """The prefill side's probe of a ``PrefillOutput`` (one decode step)."""
  return to_proto(logit_probe.make_probe(model, output.state, output.first_token))


def warm(model, max_ctx: int) -> float:
  """Compiles the probe step for every context octave below ``max_ctx`` (at
  server start, so that a probe costs one decode step from the first
  request on); returns seconds spent."""
  t0 = time.perf_counter()
  logit_probe.warm(model, max_ctx)
  return time.perf_counter() - t0


def fault_hook(plan, config) -> Callable | None:
  """The ``corrupt`` hook of a ``FaultPlan`` with ``corrupt_states`` (else None):
  damages that many received states (``sensitivity.damage``), logged."""
  if plan is None or not plan.corrupt_states:
    return None

  def corrupt(request_id: str, state):
    if not plan.take_state_corruption():
      return state
    log.error("fault: damaging the verified state of %s", request_id,
              extra={"request_id": request_id})
    return sensitivity.damage(state, config.layer_kinds)
  return corrupt


def lossy_manifest(manifest) -> bool:
  """True if the transfer quantised any array (the probe's tolerance widens)."""
  return any(getattr(a, "quantization", "none") not in ("none", "")
             for g in manifest.groups for a in g.arrays)


class HandoffVerifier:
  """Pairs each remote request's received state with its Handoff and checks it.

  Args:
    model: the decode side's model (the probe step runs on it).
    provide_state: ``f(request_id, state, info) -> bool`` (the scheduler's).
    fail: ``f(request_id, code, message)`` (the scheduler's).
    enabled: False passes every state through unchecked.
    metrics: ``ServingMetrics`` or None.
    corrupt: a fault hook ``f(request_id, state) -> state`` applied to the
      verified (crc-checked) state before the probe (the demo's
      ``--fault=corrupt_state``); None in production.
  """

  def __init__(self, model, provide_state: Callable, fail: Callable, *, enabled: bool = True,
               metrics=None, corrupt: Callable | None = None, workers: int = 2):
    self.model = model
    self.enabled = enabled
    self.metrics = metrics
    self.corrupt = corrupt
    self._provide_state = provide_state
    self._fail = fail
    self._lock = threading.Lock()
    self._states: dict[str, tuple] = {}     # rid -> (state, info, lossy, t)
    self._handoffs: dict[str, tuple] = {}   # rid -> (probe | None, t)
    self._pool = futures.ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="handoff-probe")
    self.counters = collections.Counter()
    self.check_s_total = 0.0

  def state_arrived(self, request_id: str, state, info: dict, lossy: bool = False) -> None:
    if self.corrupt is not None:
      state = self.corrupt(request_id, state)
    if not self.enabled:
      self._provide(request_id, state, info)
      return
    with self._lock:
      self._gc()
      handoff = self._handoffs.pop(request_id, None)
      if handoff is None:
        self._states[request_id] = (state, info, lossy, time.monotonic())
        return
    self._pool.submit(self._check, request_id, state, info, lossy, handoff[0])

  def handoff_arrived(self, request_id: str, probe: logit_probe.LogitProbe | None) -> None:
    """Called after the scheduler took the Handoff's first token."""
    if not self.enabled:
      return
    with self._lock:
      self._gc()
      held = self._states.pop(request_id, None)
      if held is None:
        self._handoffs[request_id] = (probe, time.monotonic())
        return
    state, info, lossy, _ = held
    self._pool.submit(self._check, request_id, state, info, lossy, probe)

  def forget(self, request_id: str) -> None:
    """The request is gone (its transfer failed, or it was cancelled)."""
    with self._lock:
      self._states.pop(request_id, None)
      self._handoffs.pop(request_id, None)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def gauges(self) -> dict:
    out = {f"handoff_probe_{o}": self.counters[o] for o in OUTCOMES}
    checked = self.counters["ok"] + self.counters["mismatch"]
    out["handoff_probe_mean_ms"] = 1e3 * self.check_s_total / max(checked, 1)
    out["handoff_probe_enabled"] = int(self.enabled)
    return out

  # -- internals ------------------------------------------------------------------

  def _gc(self) -> None:
    # Caller holds the lock.
    now = time.monotonic()
    for table in (self._states, self._handoffs):
      for rid in [r for r, v in table.items() if now - v[-1] > PENDING_TTL_S]:
        del table[rid]

  def _count(self, outcome: str) -> None:
    self.counters[outcome] += 1
    if self.metrics is not None:
      self.metrics.handoff_probes.labels(outcome).inc()

  def _provide(self, request_id: str, state, info: dict) -> None:
    if not self._provide_state(request_id, state, info):
      log.info("dropping the state of %s: the request is gone", request_id,
               extra={"request_id": request_id})

  def _check(self, request_id: str, state, info: dict, lossy: bool,
             probe: logit_probe.LogitProbe | None) -> None:
    if probe is None:
      self._count("unverified")
      self._provide(request_id, state, info)
      return
    t0 = time.perf_counter()
    try:
      result = logit_probe.check_state(self.model, state, probe, lossy=lossy)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("logit probe of %s failed to run", request_id,
                    extra={"request_id": request_id})
      self._count("error")
      self._fail(request_id, grpc.StatusCode.INTERNAL, f"checking the logit probe failed: {e!r}")
      return
    self.check_s_total += time.perf_counter() - t0
    if result.ok:
      self._count("ok")
      self._provide(request_id, state, {**info, "probe_max_diff": result.max_diff})
      return
    self._count("mismatch")
    log.warning("handed-off state failed the logit probe: %s", result.reason,
                extra={"request_id": request_id, "max_diff": result.max_diff,
                       "tolerance": result.tolerance})
    self._fail(request_id, grpc.StatusCode.DATA_LOSS,
               f"the received state failed the logit probe ({result.reason}); "
               "nothing was streamed from it")
