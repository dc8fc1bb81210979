"""Preemptible prefill: a preemption notice hands in-flight requests to resume.

On a spot / preemptible machine the notice is a SIGTERM with a grace period.
``Preemption.run(grace_s)`` then:

1. refuses new work (``admit`` raises ``PreemptedError``: UNAVAILABLE on the
   wire) while the server reports NOT_SERVING, so the broker routes elsewhere;
2. fails every prompt still waiting for a prefill batch with ``PreemptedError``
   (the broker re-routes it at once: nothing of it was computed);
3. lets the running prefills stream on for up to ``grace_s``: every segment
   that commits in that time extends the request's commit point on the decode
   side; requests that finish are done normally;
4. hands over the rest: their Prefill streams end with UNAVAILABLE naming the
   last commit point, and the broker resumes them from it (``resume.py``).

JAX-free; the prefill server registers each request (``track``) with a
callback that ends its stream.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class PreemptedError(Exception):
  """This prefill node is being preempted (UNAVAILABLE: retry elsewhere)."""


@dataclasses.dataclass
class _InFlight:
  hand_over: Callable[[], int]   # ends the request's stream; returns its commit point


@dataclasses.dataclass
class PreemptionReport:
  grace_s: float
  queued_rerouted: int = 0      # waiting prompts failed at once
  finished_in_grace: int = 0    # running prompts that completed within the grace period
  handed_over: int = 0          # running prompts handed to resume
  handed_over_tokens: int = 0   # sum of their commit points (tokens not recomputed)
  waited_s: float = 0.0


class Preemption:
  """Tracks a prefill server's in-flight requests for a preemption notice."""

  def __init__(self):
    self._lock = threading.Lock()
    self._inflight: dict[str, _InFlight] = {}
    self.preempted = threading.Event()
    self.report: PreemptionReport | None = None

  def track(self, request_id: str, hand_over: Callable[[], int]) -> None:
    """Registers a request; ``PreemptedError`` once preempted."""
    with self._lock:
      if self.preempted.is_set():
        raise PreemptedError("this prefill node is being preempted; retry elsewhere")
      self._inflight[request_id] = _InFlight(hand_over)

  def done(self, request_id: str) -> None:
    with self._lock:
      self._inflight.pop(request_id, None)

  @property
  def inflight(self) -> int:
    with self._lock:
      return len(self._inflight)

  def run(self, grace_s: float, drain_queue: Callable[[], list],
          poll_s: float = 0.02) -> PreemptionReport:
    """Steps 1-4 of the module docstring; returns what happened."""
    t0 = time.monotonic()
    report = PreemptionReport(grace_s=grace_s)
    with self._lock:
      self.preempted.set()
    for job in drain_queue():
      report.queued_rerouted += 1
      self.done(job.input.request_id)
      job.on_error(PreemptedError("this prefill node was preempted before the prompt "
                                  "started; retry elsewhere"))
    running = self.inflight
    while self.inflight and time.monotonic() - t0 < grace_s:
      time.sleep(poll_s)
    with self._lock:
      left, self._inflight = dict(self._inflight), {}
    report.finished_in_grace = running - len(left)
    for rid, entry in left.items():
      try:
        report.handed_over_tokens += int(entry.hand_over())
        report.handed_over += 1
      except Exception:  # pylint: disable=broad-except
        log.exception("handing %s over failed", rid)
    report.waited_s = time.monotonic() - t0
    self.report = report
    log.warning("preempted: %s", report)
    return report
