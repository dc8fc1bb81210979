"""Supervises a prefill pod on one machine: starts its P processes, restarts them as a unit.

``python -m paas_jax.serving.pod_prefill_server`` without ``--pod_process_id``
runs ``supervise``: it starts the P processes of the pod (the same module with
``--pod_process_id=p``, a fresh ``jax.distributed`` coordinator and
``--xla_force_host_platform_device_count=--pod_devices``), waits for process 0
to serve, and writes the ready file (its own pid, process 0's control and
transfer ports, the pod's pids and incarnation). When any process of the pod
exits, every other one is killed at once -- so an in-flight request's Prefill
stream breaks (UNAVAILABLE at the broker, which prefills it elsewhere) instead
of waiting in a collective -- and the whole pod starts again on the same
ports, without the fault plan, up to ``--max_pod_restarts`` times. The ready
file is rewritten for every incarnation. Each process dies with the
supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

from absl import flags

from paas_jax.serving import common
from paas_jax.serving.pod_launch import free_port

log = logging.getLogger("paas_jax.serving.pod_supervisor")
FLAGS = flags.FLAGS
_PR_SET_PDEATHSIG = 1
# Flags the supervisor sets per process (dropped from the arguments it passes on).
_OWN_FLAGS = ("--port", "--transfer_port", "--ready_file", "--pod_fault", "--pod_process_id",
              "--pod_coordinator")


def _die_with_parent() -> None:
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def passed_on(argv: Sequence[str]) -> list[str]:
  """``argv`` without the flags the supervisor sets per process (pure)."""
  return [a for a in argv if a.split("=", 1)[0] not in _OWN_FLAGS]


class _Pod:
  """One incarnation: P processes."""

  def __init__(self, argv: Sequence[str], incarnation: int, port: int, transfer_port: int,
               ready0: pathlib.Path):
    devices = f"--xla_force_host_platform_device_count={FLAGS.pod_devices}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {devices}".strip())
    coordinator = f"127.0.0.1:{free_port()}"
    ready0.unlink(missing_ok=True)
    self.procs = []
    for p in range(FLAGS.pod_processes):
      args = [sys.executable, "-m", "paas_jax.serving.pod_prefill_server", *passed_on(argv),
              f"--pod_process_id={p}", f"--pod_coordinator={coordinator}"]
      if p == 0:
        args += [f"--port={port}", f"--transfer_port={transfer_port}",
                 f"--ready_file={ready0}"]
      if incarnation == 0 and FLAGS.pod_fault:
        args.append(f"--pod_fault={FLAGS.pod_fault}")
      self.procs.append(subprocess.Popen(args, env=env, preexec_fn=_die_with_parent))
    log.warning("pod incarnation %d: pids %s, coordinator %s", incarnation,
                [p.pid for p in self.procs], coordinator)

  def exited(self) -> list[tuple[int, int]]:
    return [(i, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      p.wait()

  def terminate(self, timeout_s: float = 10.0) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in self.procs:
      try:
        p.wait(max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def supervise(argv: Sequence[str]) -> int:
  """Runs the pod until SIGTERM (0) or until it failed ``--max_pod_restarts``
  times in a row (1)."""
  common.setup_logging(FLAGS.log_level)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  ready = pathlib.Path(FLAGS.ready_file) if FLAGS.ready_file else None
  ready0 = pathlib.Path(f"{ready or f'/tmp/pod_prefill.{os.getpid()}'}.process0.json")
  port, transfer_port = FLAGS.port, FLAGS.transfer_port
  restarts: list[dict] = []
  incarnation = 0
  while not stop.is_set():
    t0 = time.monotonic()
    pod = _Pod(argv, incarnation, port, transfer_port, ready0)
    info = None
    while not stop.is_set():
      gone = pod.exited()
      if gone:
        pod.kill()
        restarts.append({"incarnation": incarnation, "process": gone[0][0],
                         "returncode": gone[0][1], "served": info is not None,
                         "seconds": round(time.monotonic() - t0, 3)})
        log.error("pod process %d exited with %s: restarting the pod as a unit (%d of %d)",
                  gone[0][0], gone[0][1], len(restarts), FLAGS.max_pod_restarts)
        break
      if info is None and ready0.exists():
        info = json.loads(ready0.read_text())
        port, transfer_port = info["port"], info["transfer_port"]
        common.write_ready_file(str(ready) if ready else None, dict(
            info, pid=os.getpid(), pod_pids=[p.pid for p in pod.procs],
            incarnation=incarnation, restarts=restarts))
      time.sleep(0.05)
    if stop.is_set():
      pod.terminate()
      return 0
    if (info is None and incarnation == 0) or len(restarts) > FLAGS.max_pod_restarts:
      log.error("pod gave up after %d restarts: %s", len(restarts) - 1, restarts)
      return 1
    incarnation += 1
  return 0
