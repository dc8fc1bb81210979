"""Starts a prefill pod and a decode slice as local processes (tests, benches).

``run_local`` spawns the P pod processes (and, for Q > 1, the Q slice
processes) of ``python -m paas_jax.serving.pod_worker``, each with its own
``--xla_force_host_platform_device_count``; a single-process slice may run
in the caller instead (``in_process_devices``). Every process has a deadline:
the first one to fail (or to overrun) takes the others down, and the error
(``PodFailure``, with a gRPC status) carries its stderr.

``run_supervised`` is the pod fault path: when a pod process dies mid-prefill
or mid-transfer, the request's attempt fails with UNAVAILABLE, every process of
that pod and of the slice is stopped (the slice restores nothing it received
from a broken pod), and the pod restarts as a unit -- all P processes, a new
coordinator -- and prefills the request again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Sequence

import grpc

from paas_jax.codec.shard_plan import MeshSpec
from paas_jax.models.config import ModelConfig
from paas_jax.serving import pod_worker
from paas_jax.serving.ports import free_port


class PodFailure(RuntimeError):
  """A pod or slice process died (UNAVAILABLE) or overran the deadline
  (DEADLINE_EXCEEDED); ``finished``: the processes that had reported before."""

  def __init__(self, code: grpc.StatusCode, process: str, returncode: int | None,
               detail: str, finished: Sequence[str] = ()):
    super().__init__(f"{code.name}: {process} "
                     + (f"exited with {returncode}" if returncode is not None
                        else "still running at the deadline") + f":\n{detail}")
    self.code = code
    self.process = process
    self.returncode = returncode
    self.finished = tuple(finished)
    self.detail = detail

  def __reduce__(self):  # crosses process boundaries (Ray actors) intact
    return (PodFailure, (self.code, self.process, self.returncode, self.detail, self.finished))


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One failed try of ``run_supervised``: the pod incarnation, the status,
  the process that failed and how, and which processes had finished."""

  incarnation: int
  code: str
  process: str
  returncode: int | None
  finished: tuple[str, ...]
  seconds: float


@dataclasses.dataclass(frozen=True)
class LocalRun:
  """What every process reported (``pod_worker`` reports), by rank;
  ``attempts``: the failed tries before this one (``run_supervised``)."""

  prefill: list[dict]
  decode: list[dict]
  seconds: float
  attempts: tuple[Attempt, ...] = ()


def _region(num_processes: int, local_devices: int, process_id: int, coordinator: str,
            timeout_s: float) -> dict:
  return {"coordinator": coordinator, "num_processes": num_processes,
          "process_id": process_id, "local_devices": local_devices, "timeout_s": timeout_s}


def _spawn(spec: dict, workdir: pathlib.Path, name: str, devices: int) -> tuple:
  spec_path = workdir / f"{name}.spec.json"
  report_path = workdir / f"{name}.report.json"
  spec_path.write_text(json.dumps(spec))
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  log = open(workdir / f"{name}.log", "w")
  proc = subprocess.Popen([sys.executable, "-m", "paas_jax.serving.pod_worker",
                           f"--spec={spec_path}", f"--report={report_path}"],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
  return name, proc, report_path, log


def _wait_all(procs: list[tuple], deadline: float) -> dict[str, dict]:
  reports = {}
  try:
    pending = list(procs)
    while pending:
      for item in list(pending):
        name, proc, report_path, log = item
        rc = proc.poll()
        if rc is None:
          continue
        pending.remove(item)
        log.close()
        if rc != 0:
          tail = (report_path.parent / f"{name}.log").read_text()[-3000:]
          raise PodFailure(grpc.StatusCode.UNAVAILABLE, name, rc, tail, sorted(reports))
        reports[name] = json.loads(report_path.read_text())
      if pending and time.monotonic() > deadline:
        raise PodFailure(grpc.StatusCode.DEADLINE_EXCEEDED, pending[0][0], None,
                         f"{[p[0] for p in pending]} still running at the deadline",
                         sorted(reports))
      time.sleep(0.05)
  finally:
    for name, proc, _, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()
  return reports


def request_specs(config: ModelConfig, prompt: Sequence[int], *, request_id: str,
                  pod_processes: int, pod_devices: int, slice_device_owners: Sequence[int],
                  max_new_tokens: int, timeout_s: float, pod_coordinator: str,
                  slice_coordinator: str, targets: Sequence[str], seed: int = 0,
                  codec: dict | None = None, synthetic_tokens: int | None = None,
                  fault: dict | None = None) -> tuple[list[dict], list[dict]]:
  """The ``pod_worker`` specs of one request: (pod process specs by rank,
  slice process specs by rank). ``slice_device_owners``: the slice process of
  each slice device (its mesh); ``targets``: each slice process's address."""
  common = {"config": config.to_dict(), "seed": seed, "request_id": request_id}
  if synthetic_tokens is not None:
    common["synthetic_tokens"] = int(synthetic_tokens)
  slice_processes = len(targets)
  owners = tuple(slice_device_owners)
  target_mesh = MeshSpec(("tp",), (len(owners),), owners).to_dict()
  slice_specs = [dict(common, role="decode", address=targets[q], max_new_tokens=max_new_tokens,
                      region=_region(slice_processes, len(owners) // slice_processes, q,
                                     slice_coordinator, timeout_s))
                 for q in range(slice_processes)]
  pod_specs = [dict(common, role="prefill", prompt=list(map(int, prompt)), targets=list(targets),
                    target_mesh=target_mesh, codec=codec or {}, fault=fault or {},
                    region=_region(pod_processes, pod_devices, p, pod_coordinator, timeout_s))
               for p in range(pod_processes)]
  return pod_specs, slice_specs


def run_local(config: ModelConfig, prompt: Sequence[int], *, pod_processes: int,
              pod_devices: int, slice_processes: int, slice_devices: int,
              max_new_tokens: int, workdir: str | pathlib.Path, timeout_s: float = 120.0,
              seed: int = 0, codec: dict | None = None,
              in_process_devices: Sequence[Any] | None = None,
              synthetic_tokens: int | None = None, fault: dict | None = None) -> LocalRun:
  """Runs one request: prefill on the pod, shard-to-shard transfer, decode on
  the slice. With ``in_process_devices`` (Q = 1 only), the slice runs in this
  process on those devices. With ``synthetic_tokens``, the pod makes a random
  full state of that many tokens instead of a prefill, and the slice restores
  it without decoding (transfer benchmarks); ``prompt`` is then unused.
  ``fault``: a pod process dies (``pod_worker``'s fault plan)."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  request_id = uuid.uuid4().hex[:12]
  t0 = time.monotonic()
  deadline = t0 + timeout_s
  slice_coord = f"127.0.0.1:{free_port()}"
  in_process = in_process_devices is not None
  if in_process and slice_processes != 1:
    raise ValueError("only a single-process slice runs in the caller")
  server = None
  slice_procs = []
  if in_process:
    server = pod_worker.start_slice_receiver(config, "127.0.0.1:0", timeout_s)
    targets = [server.target]
    processes = (0,) * len(in_process_devices)
  else:
    targets = [f"127.0.0.1:{free_port()}" for _ in range(slice_processes)]
    processes = tuple(p for p in range(slice_processes) for _ in range(slice_devices))
  pod_specs, slice_specs = request_specs(
      config, prompt, request_id=request_id, pod_processes=pod_processes,
      pod_devices=pod_devices, slice_device_owners=processes,
      max_new_tokens=max_new_tokens, timeout_s=timeout_s,
      pod_coordinator=f"127.0.0.1:{free_port()}", slice_coordinator=slice_coord,
      targets=targets, seed=seed, codec=codec, synthetic_tokens=synthetic_tokens, fault=fault)
  try:
    if not in_process:
      slice_procs = [_spawn(s, workdir, f"decode{q}", slice_devices)
                     for q, s in enumerate(slice_specs)]
    pod_procs = [_spawn(s, workdir, f"prefill{p}", pod_devices)
                 for p, s in enumerate(pod_specs)]
    decode_reports = []
    if in_process:
      # The slice runs in a thread so that a pod process that dies fails the
      # run at once instead of after the slice's own deadline.
      outcome: dict = {}

      def slice_main():
        try:
          outcome["report"] = pod_worker.run_slice(slice_specs[0], server=server,
                                                   devices=in_process_devices)
        except BaseException as e:  # Re-raised in the caller's thread.
          outcome["error"] = e

      thread = threading.Thread(target=slice_main, name="pod-slice", daemon=True)
      thread.start()
      reports = _wait_all(pod_procs, deadline)
      thread.join(max(0.0, deadline - time.monotonic()))
      if thread.is_alive():
        raise TimeoutError("the in-process slice did not finish by the deadline")
      if "error" in outcome:
        raise outcome["error"]
      decode_reports = [outcome["report"]]
    else:
      reports = _wait_all(pod_procs + slice_procs, deadline)
  finally:
    if server is not None:
      server.stop(grace=None)
  prefill = [reports[f"prefill{p}"] for p in range(pod_processes)]
  if not in_process:
    decode_reports = [reports[f"decode{q}"] for q in range(slice_processes)]
  return LocalRun(prefill, decode_reports, time.monotonic() - t0)


def run_supervised(config: ModelConfig, prompt: Sequence[int], *, workdir: str | pathlib.Path,
                   max_pod_restarts: int = 1, fault: dict | None = None,
                   **kwargs) -> LocalRun:
  """``run_local`` with pod faults handled: an attempt whose pod (or slice)
  process dies fails with its status; the whole pod and slice are stopped and
  started again as a unit (fresh processes, coordinator and ports), and the
  request is prefilled again, up to ``max_pod_restarts`` times. ``fault``
  applies to the first incarnation only (a lost machine, replaced)."""
  attempts: list[Attempt] = []
  workdir = pathlib.Path(workdir)
  for incarnation in range(max_pod_restarts + 1):
    t0 = time.monotonic()
    try:
      run = run_local(config, prompt, workdir=workdir / f"pod{incarnation}",
                      fault=fault if incarnation == 0 else None, **kwargs)
    except PodFailure as e:
      attempts.append(Attempt(incarnation, e.code.name, e.process, e.returncode, e.finished,
                              time.monotonic() - t0))
      if incarnation == max_pod_restarts:
        raise PodFailure(e.code, e.process, e.returncode,
                         f"after {len(attempts)} pod incarnations: {attempts}",
                         e.finished) from e
      continue
    return dataclasses.replace(run, attempts=tuple(attempts))
  raise AssertionError("unreachable")
