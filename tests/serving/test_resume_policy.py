"""The broker's resume policy and the prefill server's preemption bookkeeping
(both JAX-free; the process-level tests are in test_resume_serving.py)."""

from __future__ import annotations

import threading
import time

import prometheus_client as prom
import pytest

from paas_jax.serving.resume import ResumeMetrics, ResumePolicy
from paas_jax.serving.resume_preempt import PreemptedError, Preemption
from paas_jax.serving.routing import PDP, PRFAAS, StaticThresholdPolicy

BASE = dict(prompt_tokens=300, earlier_id="r", decode_index=0, decode_healthy=True,
            other_prefill=True, streamed=True)


def test_resume_policy_uses_the_routers_model():
  policy = ResumePolicy(StaticThresholdPolicy(100))
  # 44 tokens left <= t: resume on the node that holds the commit point.
  d = policy.decide(**{**BASE, "commit_point": 256})
  assert d.resume and d.route == PDP and d.decode_index == 0 and d.commit_point == 256
  # Nothing committed, 300 > t, another PrfaaS node: re-prefill remotely.
  d = policy.decide(**{**BASE, "commit_point": 0})
  assert not d.resume and d.route == PRFAAS
  # No other prefill server: resume (from whatever the decode node holds).
  d = policy.decide(**{**BASE, "commit_point": 0, "other_prefill": False})
  assert d.resume and d.route == PDP
  # A commit point is never the whole prompt: the first token needs the last position.
  assert policy.decide(**{**BASE, "commit_point": 300}).commit_point == 299


@pytest.mark.parametrize("change", [{"streamed": False}, {"decode_healthy": False},
                                    {"decode_index": -1}])
def test_not_resumable(change):
  assert ResumePolicy(StaticThresholdPolicy(100)).decide(
      **{**BASE, "commit_point": 128, **change}) is None
  assert ResumePolicy(enabled=False).decide(**{**BASE, "commit_point": 128}) is None


def test_resume_metrics_count_saved_tokens():
  registry = prom.CollectorRegistry()
  m = ResumeMetrics(registry)
  m.observe("pdp", 256, 44)
  m.observe("pdp", 0, 300)  # a full re-prefill is not a resumed request
  assert registry.get_sample_value("paas_resume_saved_tokens_total") == 256
  assert registry.get_sample_value("paas_resume_recomputed_tokens_total") == 344
  assert registry.get_sample_value("paas_resumed_requests_total", {"route": "pdp"}) == 1


class _Job:
  def __init__(self, rid):
    self.input = type("I", (), {"request_id": rid})()
    self.errors = []

  def on_error(self, e):
    self.errors.append(e)


def test_preemption_hands_over_what_outlives_the_grace_period():
  p = Preemption()
  handed = []
  p.track("running", lambda: handed.append("running") or 128)
  p.track("finishes", lambda: handed.append("finishes") or 0)
  queued = _Job("queued")
  p.track("queued", lambda: 0)
  threading.Timer(0.05, lambda: p.done("finishes")).start()
  t0 = time.monotonic()
  report = p.run(0.3, lambda: [queued])
  assert time.monotonic() - t0 >= 0.3
  assert isinstance(queued.errors[0], PreemptedError)
  assert handed == ["running"]
  assert (report.queued_rerouted, report.finished_in_grace, report.handed_over,
          report.handed_over_tokens) == (1, 1, 1, 128)
  with pytest.raises(PreemptedError):  # no new work once preempted
    p.track("late", lambda: 0)


def test_preemption_without_inflight_work_returns_at_once():
  t0 = time.monotonic()
  report = Preemption().run(5.0, list)
  assert time.monotonic() - t0 < 1.0 and report.handed_over == 0
