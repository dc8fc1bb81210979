"""Supervises a region's processes on one machine (a prefill pod, a decode slice):
starts them, restarts them as a unit.

``python -m paas_jax.serving.pod_prefill_server`` without ``--pod_process_id``
(and ``slice_decode_server`` without ``--slice_process_id``) runs
``supervise``: it starts the region's processes (the same module with
``--<kind>_process_id=p``, a fresh ``jax.distributed`` coordinator and
``--xla_force_host_platform_device_count=<devices>``), waits for process 0
to serve, and writes the ready file (its own pid, process 0's ready file --
control and transfer ports -- the processes' pids and incarnation). A decode
slice's every process serves its own StateTransfer port: the supervisor
fixes those ports at the first start, so that a restarted slice is reached
where its broker and its prefill pod expect it (a supervisor started again
in a killed one's place is given them: ``--<kind>_transfer_ports``,
``--<kind>_data_plane_ports``). When any process of the pod
exits, every other one is killed at once -- so an in-flight request's Prefill
stream breaks (UNAVAILABLE at the broker, which prefills it elsewhere) instead
of waiting in a collective -- and the whole pod starts again on the same
ports, without the fault plan, up to ``--max_pod_restarts`` times. The ready
file is rewritten for every incarnation. Each process dies with the
supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import dataclasses
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
from paas_jax.serving.child_process import set_parent_death_signal
from paas_jax.serving.ports import free_port

log = logging.getLogger("paas_jax.serving.pod_supervisor")
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class RegionProcesses:
  """What the supervisor starts: ``processes`` x ``module`` with ``--<kind>_process_id``
  and ``--<kind>_coordinator``, ``devices`` each; ``fault``: the value of
  ``--<kind>_fault`` for the first incarnation; ``own_transfer_ports``: every
  process serves a StateTransfer port (a decode slice), not only process 0;
  ``own_data_plane_ports``: and a TCP data plane, on a port fixed at the
  first start (``--data_plane_port``), as the transfer ports are."""

  module: str = "paas_jax.serving.pod_prefill_server"
  kind: str = "pod"
  processes: int = 2
  devices: int = 1
  fault: str = ""
  max_restarts: int = 5
  own_transfer_ports: bool = False
  own_data_plane_ports: bool = False

  def own_flags(self) -> tuple[str, ...]:
    """Flags the supervisor sets per process (dropped from the arguments it passes on)."""
    return ("--port", "--transfer_port", "--ready_file", f"--{self.kind}_fault",
            f"--{self.kind}_process_id", f"--{self.kind}_coordinator",
            f"--{self.kind}_transfer_ports", f"--{self.kind}_data_plane_ports") + (
                ("--data_plane_port",) if self.own_data_plane_ports else ())


def define_region_flags(kind: str) -> None:
  """The flags of a multi-process region: ``--<kind>_processes``,
  ``--<kind>_devices``, ``--<kind>_process_id``, ``--<kind>_coordinator``,
  ``--<kind>_timeout_s`` and ``--max_<kind>_restarts`` (``kind``: "pod", "slice")."""
  noun = kind
  letter = "P" if kind == "pod" else "Q"
  flags.DEFINE_integer(f"{kind}_processes", 2, f"Processes of the {noun} ({letter}).")
  flags.DEFINE_integer(f"{kind}_devices", 1, f"Devices each {noun} process contributes (on "
                       f"CPU: --xla_force_host_platform_device_count); TP = {letter} x this.")
  flags.DEFINE_integer(f"{kind}_process_id", -1, "This process's rank; -1: supervise the "
                       f"whole {noun} on this machine (pod_supervisor).")
  flags.DEFINE_string(f"{kind}_coordinator", "", f"host:port of the {noun}'s jax.distributed "
                      "coordinator (process 0's machine).")
  flags.DEFINE_float(f"{kind}_timeout_s", 60.0, f"Deadline of joining the {noun} and of "
                     "every exchange between its processes.")
  flags.DEFINE_integer(f"max_{kind}_restarts", 5, f"{noun.capitalize()} restarts (as a "
                       "unit) before the supervisor gives up.")
  flags.DEFINE_list(f"{kind}_transfer_ports", [], "StateTransfer ports of processes 1, 2, "
                    "... when each serves one (a decode slice); empty: free ports. A "
                    "supervisor started again in their place (LocalCluster.restart) gets "
                    "the old ones, so the broker, the pod and the relay still reach them.")
  flags.DEFINE_list(f"{kind}_data_plane_ports", [], "TCP data-plane ports of processes 0, "
                    "1, ... (a decode slice), likewise; empty: free ports.")


def passed_on(argv: Sequence[str], region: RegionProcesses = RegionProcesses()) -> list[str]:
  """``argv`` without the flags the supervisor sets per process (pure)."""
  own = region.own_flags()
  return [a for a in argv if a.split("=", 1)[0] not in own]


class _Pod:
  """One incarnation: the region's processes."""

  def __init__(self, argv: Sequence[str], region: RegionProcesses, incarnation: int,
               port: int, transfer_ports: Sequence[int], ready0: pathlib.Path,
               data_plane_ports: Sequence[int] = ()):
    devices = f"--xla_force_host_platform_device_count={region.devices}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {devices}".strip())
    coordinator = f"127.0.0.1:{free_port()}"
    ready0.unlink(missing_ok=True)
    kind = region.kind
    self.procs = []
    for p in range(region.processes):
      args = [sys.executable, "-m", region.module, *passed_on(argv, region),
              f"--{kind}_process_id={p}", f"--{kind}_coordinator={coordinator}"]
      if p == 0:
        args += [f"--port={port}", f"--ready_file={ready0}"]
      if p == 0 or region.own_transfer_ports:
        args.append(f"--transfer_port={transfer_ports[p]}")
      if data_plane_ports:
        args.append(f"--data_plane_port={data_plane_ports[p]}")
      if incarnation == 0 and region.fault:
        args.append(f"--{kind}_fault={region.fault}")
      self.procs.append(subprocess.Popen(args, env=env, preexec_fn=set_parent_death_signal))
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


def _fixed_ports(region: RegionProcesses, name: str, count: int) -> list[int]:
  """``--<kind>_<name>`` as ints ([] when not given).

  Raises:
    ValueError: not ``count`` ports.
  """
  given = [int(p) for p in getattr(FLAGS, f"{region.kind}_{name}", [])]
  if given and len(given) != count:
    raise ValueError(f"--{region.kind}_{name} needs {count} ports, got {given}")
  return given


def supervise(argv: Sequence[str], region: RegionProcesses | None = None) -> int:
  """Runs the region until SIGTERM (0) or until it failed ``max_restarts``
  times in a row (1). ``region``: None: the prefill pod of the ``--pod_*`` flags."""
  if region is None:
    region = RegionProcesses(processes=FLAGS.pod_processes, devices=FLAGS.pod_devices,
                             fault=FLAGS.pod_fault, max_restarts=FLAGS.max_pod_restarts)
  common.setup_logging(FLAGS.log_level)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  ready = pathlib.Path(FLAGS.ready_file) if FLAGS.ready_file else None
  ready0 = pathlib.Path(f"{ready or f'/tmp/pod_prefill.{os.getpid()}'}.process0.json")
  port = FLAGS.port
  fixed_transfer = _fixed_ports(region, "transfer_ports", region.processes - 1)
  fixed_data_plane = _fixed_ports(region, "data_plane_ports", region.processes)
  transfer_ports = [FLAGS.transfer_port] + (fixed_transfer or [
      free_port() if region.own_transfer_ports else 0 for _ in range(1, region.processes)])
  data_plane_ports = fixed_data_plane or ([free_port() for _ in range(region.processes)]
                                          if region.own_data_plane_ports else [])
  restarts: list[dict] = []
  incarnation = 0
  while not stop.is_set():
    t0 = time.monotonic()
    pod = _Pod(argv, region, incarnation, port, transfer_ports, ready0, data_plane_ports)
    info = None
    while not stop.is_set():
      gone = pod.exited()
      if gone:
        pod.kill()
        restarts.append({"incarnation": incarnation, "process": gone[0][0],
                         "returncode": gone[0][1], "served": info is not None,
                         "seconds": round(time.monotonic() - t0, 3)})
        log.error("pod process %d exited with %s: restarting the pod as a unit (%d of %d)",
                  gone[0][0], gone[0][1], len(restarts), region.max_restarts)
        break
      if info is None and ready0.exists():
        info = json.loads(ready0.read_text())
        port, transfer_ports[0] = info["port"], info["transfer_port"]
        common.write_ready_file(str(ready) if ready else None, dict(
            info, pid=os.getpid(), pod_pids=[p.pid for p in pod.procs],
            incarnation=incarnation, restarts=restarts))
      time.sleep(0.05)
    if stop.is_set():
      pod.terminate()
      return 0
    if (info is None and incarnation == 0) or len(restarts) > region.max_restarts:
      log.error("pod gave up after %d restarts: %s", len(restarts) - 1, restarts)
      return 1
    incarnation += 1
  return 0
