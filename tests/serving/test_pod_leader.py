"""``pod_prefill.PodLeader``'s queue (process 0 of a prefill pod), with a stand-in
runner: one job at a time, in arrival order or shared between tenants by
weighted fair queueing, a job whose RPC ended before it started is skipped, a
failed job breaks the pod (fast, no JAX program)."""

from __future__ import annotations

import queue
import threading

from paas_jax.scheduling.tenant_queue import TenantPolicy
from paas_jax.serving import pod
from paas_jax.serving.pod_prefill import PodLeader


class _Runner:
  """Runs jobs as a pod process would report them; the first waits for ``go``."""

  def __init__(self, fail: bool = False):
    self.region = pod.RegionSpec("", 1, 0, 1, 5.0)
    self.go = threading.Event()
    self.ran = []
    self.fail = fail

  def run(self, job, on_first=None):
    if not self.ran:
      self.go.wait(10)
    self.ran.append(job.request_id)
    if self.fail:
      raise RuntimeError("lost a collective")
    return {"ok": True, "process": 0, "state_bytes": 10, "wire_bytes": 12, "transfer_s": 0.1,
            "objects": 3}


def _fields(rid):
  return {"request_id": rid, "prompt": (1, 2, 3), "decode_target": "x:1"}


def _last(events: queue.Queue):
  return events.get(timeout=10)


def test_a_request_cancelled_while_queued_is_skipped_and_the_rest_run_in_order():
  runner = _Runner()
  leader = PodLeader(runner)
  first, skipped, third = queue.Queue(), queue.Queue(), queue.Queue()
  cancelled = threading.Event()
  leader.submit(_fields("a"), first)
  leader.submit(_fields("b"), skipped, cancelled)
  leader.submit(_fields("c"), third, threading.Event())  # not cancelled: runs
  cancelled.set()
  runner.go.set()
  assert _last(first)[0] == "done" and _last(third)[0] == "done"
  assert runner.ran == ["a", "c"] and leader.jobs_skipped == 1 and skipped.empty()
  assert leader.jobs_done == 2 and not leader.broken


def test_a_job_that_raises_breaks_the_pod_and_fails_the_queue():
  runner = _Runner(fail=True)
  broken = threading.Event()
  leader = PodLeader(runner, on_broken=broken.set)
  first, second = queue.Queue(), queue.Queue()
  leader.submit(_fields("a"), first)
  leader.submit(_fields("b"), second)
  runner.go.set()
  kind, code, _ = _last(first)
  assert (kind, code) == ("error", "UNAVAILABLE") and broken.is_set() and leader.broken
  kind, code, message = _last(second)
  assert (kind, code) == ("error", "UNAVAILABLE") and "restarting" in message
  assert runner.ran == ["a"]


def _served_order(policy):
  runner = _Runner()
  leader = PodLeader(runner, tenants=policy)
  leader.submit(_fields("first"), queue.Queue(), tenant="B")  # holds the pod
  done = []
  for i in range(4):  # region B's burst, then region C's prompts
    done.append(queue.Queue())
    leader.submit(_fields(f"B{i}"), done[-1], tenant="B")
  for i in range(2):
    done.append(queue.Queue())
    leader.submit(_fields(f"C{i}"), done[-1], tenant="C")
  if policy.quota("C"):
    assert not leader.admits("C") and leader.admits("B")  # C's quota of 2 is waiting
  runner.go.set()
  for q in done:
    assert _last(q)[0] == "done"
  return runner.ran[1:], leader


def test_tenants_share_the_pod_by_weighted_fair_queueing():
  fair, leader = _served_order(TenantPolicy.parse("", "C=2", fair=True))
  fifo, _ = _served_order(TenantPolicy(fair=False))
  assert fifo == ["B0", "B1", "B2", "B3", "C0", "C1"]  # negative control: arrival order
  assert fair.index("C0") < fair.index("B1") and fair.index("C1") < fair.index("B3"), fair
  assert leader.tenant_served_tokens() == {"B": 15.0, "C": 6.0}
