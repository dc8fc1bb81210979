"""Stopping a region of processes is quiet: SIGTERM ends a follower at once.

Two real processes join one ``jax.distributed`` group through
``pod.initialize_region``; process 1 then waits for jobs in the coordination
key-value store (``lockstep.follow``, what pod and slice followers do) and
process 0 waits for SIGTERM with its own handler, then ``os._exit``s, as
the pod and slice servers do (``common.wait_for_termination``). The supervisor's stop sends
both SIGTERM at once (``pod_supervisor._Pod.terminate``). The follower must
die of that signal, not abort on its own later. The negative control joins
the group as ``initialize_region`` did before (JAX's preemption service on):
the service takes SIGTERM for a preemption notice, the follower keeps
running, and once process 0 and its coordination service are gone it aborts
("the JAX distributed service detected fatal errors"), which is what every
cluster stop printed (with a core file) before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paas_jax.serving import ports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROCESS = textwrap.dedent("""
    import os, signal, sys, threading
    import jax
    from paas_jax.serving import lockstep, pod
    process_id, coordinator, old_join = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    spec = pod.RegionSpec(coordinator, 2, process_id, 1, timeout_s=30)
    if old_join:  # initialize_region before this change: the preemption service on
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=2,
                                 process_id=process_id, initialization_timeout=30,
                                 heartbeat_timeout_seconds=15, shutdown_timeout_seconds=30)
    else:
      pod.initialize_region(spec)
    if process_id == 0:  # as the servers' process 0: its own handler, then os._exit
      stop = threading.Event()
      signal.signal(signal.SIGTERM, lambda *_: stop.set())
      print("ready", flush=True)  # only once the handler is in place
      stop.wait()
      os._exit(0)
    print("ready", flush=True)
    lockstep.follow(pod.kv_client(), "jobs", process_id, lambda job: {})
""")


def _start_region(old_join: bool) -> list[subprocess.Popen]:
  coordinator = f"127.0.0.1:{ports.free_port('')}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(p), coordinator,
                             "1" if old_join else "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for p in range(2)]
  for p in procs:
    line = p.stdout.readline()  # joining waits for both; a failure closes stdout
    assert line.strip() == "ready", p.communicate(timeout=30)[1][-3000:]
  return procs


# Slow: in a CI run beside the whole suite, the control's process 0 did not exit
# within 30 s of SIGTERM (the old join: JAX's preemption service on); not yet understood.
@pytest.mark.slow
@pytest.mark.parametrize("old_join", [False, True], ids=["initialize_region", "control"])
def test_sigterm_stops_a_follower_at_once_and_quietly(old_join):
  procs = _start_region(old_join)
  try:
    for p in procs:  # the supervisor's stop: every process at once
      p.send_signal(signal.SIGTERM)
    leader_rc = procs[0].wait(timeout=30)
    follower_rc = procs[1].wait(timeout=60)
    follower_err = procs[1].stderr.read()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert leader_rc == 0
  aborted = "Terminating process because the JAX distributed service" in follower_err
  if old_join:  # it outlived SIGTERM and then ended badly (an abort, or a traceback
    # when its key-value read failed first), never as asked
    assert follower_rc not in (0, -signal.SIGTERM), (follower_rc, follower_err[-2000:])
    assert aborted or "Traceback" in follower_err, follower_err[-2000:]
  else:
    assert follower_rc == -signal.SIGTERM and not aborted, (follower_rc, follower_err[-2000:])
