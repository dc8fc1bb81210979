"""A prefill pod and a decode slice placed by Ray (``pod_launch.run_local`` on Ray).

The P pod processes are one placement group on ``region_a`` nodes and the Q
slice processes another on ``region_b`` nodes. A placement group is
gang-scheduled: Ray reserves every bundle before any process starts. So a pod
never starts half-placed, with processes waiting at their coordinator barrier
for peers that cannot be scheduled. A pod that does not fit fails with
``PodFailure(RESOURCE_EXHAUSTED)`` and starts nothing.

Each process is a ``PodProcess`` actor that runs ``python -m
paas_jax.serving.pod_worker`` as its child (``PR_SET_PDEATHSIG``: killing the
actor kills the process). The coordinators and slice addresses are free ports on
the nodes that Ray chose. The first process to fail stops all the others, as in
``run_local``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Sequence

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paas_jax.models.config import ModelConfig
from paas_jax.serving import ports
from paas_jax.serving.child_process import set_parent_death_signal
from paas_jax.serving.pod_launch import LocalRun, PodFailure, request_specs
from paas_jax.serving.ray_launch import REGION_SHARE, REPO


@dataclasses.dataclass(frozen=True)
class PodPlacement:
  """Where the pod and slice go: region resources, CPUs per process, and how
  a region's processes spread over its nodes (PACK: as few nodes as possible;
  STRICT_SPREAD: one process per node, a pod over several machines)."""

  pod_resource: str = "region_a"
  slice_resource: str = "region_b"
  cpus_per_process: float = 1.0
  strategy: str = "PACK"
  placement_timeout_s: float = 60.0


@ray.remote
class PodProcess:
  """One pod or slice process on its Ray node."""

  def node(self) -> dict:
    return {"node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id()}

  def free_port(self) -> int:
    """A port announced to the pod before its process binds it (ports.free_port)."""
    return ports.free_port("")

  def run(self, spec: dict, devices: int, timeout_s: float) -> dict:
    """Runs the process to its end; its report plus where it ran. A nonzero
    exit raises ``PodFailure(UNAVAILABLE)`` carrying the log tail."""
    name = f"{spec['role']}{spec['region']['process_id']}"
    with tempfile.TemporaryDirectory(prefix="paas_pod_") as tmp:
      spec_path, report_path = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "report.json")
      log_path = pathlib.Path(tmp, "log.txt")
      spec_path.write_text(json.dumps(spec))
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                 JAX_PLATFORMS="cpu")
      env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [
          p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
      with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "paas_jax.serving.pod_worker", f"--spec={spec_path}",
             f"--report={report_path}"], env=env, stdout=log, stderr=subprocess.STDOUT,
            cwd=str(REPO), preexec_fn=set_parent_death_signal)  # pylint: disable=subprocess-popen-preexec-fn
        try:
          rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
          raise PodFailure(grpc.StatusCode.DEADLINE_EXCEEDED, name, None,
                           log_path.read_text(errors="replace")[-3000:]) from None
      if rc != 0:
        raise PodFailure(grpc.StatusCode.UNAVAILABLE, name, rc,
                         log_path.read_text(errors="replace")[-3000:])
      return dict(json.loads(report_path.read_text()), **self.node())


def _group(resource: str, n: int, placement: PodPlacement):
  bundle = {resource: REGION_SHARE}
  if placement.cpus_per_process:
    bundle["CPU"] = placement.cpus_per_process
  return placement_group([dict(bundle) for _ in range(n)], strategy=placement.strategy)


def _failure(err: BaseException, name: str, finished: Sequence[str]) -> PodFailure:
  if isinstance(err, ray.exceptions.RayTaskError):
    cause = err.as_instanceof_cause()
    if isinstance(cause, PodFailure):
      return PodFailure(cause.code, cause.process, cause.returncode,
                        str(cause).split("\n", 1)[-1], finished)
  return PodFailure(grpc.StatusCode.UNAVAILABLE, name, None, f"its actor died: {err}", finished)


def run_ray(config: ModelConfig, prompt: Sequence[int], *, pod_processes: int,
            pod_devices: int, slice_processes: int, slice_devices: int, max_new_tokens: int,
            timeout_s: float = 300.0, seed: int = 0, codec: dict | None = None,
            fault: dict | None = None,
            placement: PodPlacement = PodPlacement()) -> LocalRun:
  """One request on a Ray-placed pod and slice (``pod_launch.run_local``'s
  contract). Ray must be initialised (``ray.init``). Each report gains the
  ``node_id``/``node_ip`` it ran on."""
  t0 = time.monotonic()
  deadline = t0 + timeout_s
  groups = [_group(placement.pod_resource, pod_processes, placement),
            _group(placement.slice_resource, slice_processes, placement)]
  actors: list = []
  try:
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=2,
                        timeout=placement.placement_timeout_s)
    if len(ready) < 2:
      raise PodFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "placement", None,
                       f"the pod ({pod_processes} x {groups[0].bundle_specs[0]}) or slice "
                       f"({slice_processes} x {groups[1].bundle_specs[0]}) was not placed "
                       f"within {placement.placement_timeout_s:.0f} s; nothing was started "
                       f"(cluster: {ray.cluster_resources()})")

    def actor(group, i):
      res = dict(group.bundle_specs[i])
      return PodProcess.options(
          num_cpus=res.pop("CPU", 0), resources=res, max_concurrency=4,
          scheduling_strategy=PlacementGroupSchedulingStrategy(
              group, placement_group_bundle_index=i)).remote()

    pods = [actor(groups[0], p) for p in range(pod_processes)]
    slices = [actor(groups[1], q) for q in range(slice_processes)]
    actors = pods + slices
    pod_node = ray.get(pods[0].node.remote())
    slice_nodes = ray.get([s.node.remote() for s in slices])
    pod_coord = f"{pod_node['node_ip']}:{ray.get(pods[0].free_port.remote())}"
    slice_coord = f"{slice_nodes[0]['node_ip']}:{ray.get(slices[0].free_port.remote())}"
    targets = [f"{n['node_ip']}:{p}" for n, p in
               zip(slice_nodes, ray.get([s.free_port.remote() for s in slices]))]
    owners = tuple(q for q in range(slice_processes) for _ in range(slice_devices))
    pod_specs, slice_specs = request_specs(
        config, prompt, request_id=uuid.uuid4().hex[:12], pod_processes=pod_processes,
        pod_devices=pod_devices, slice_device_owners=owners, max_new_tokens=max_new_tokens,
        timeout_s=timeout_s, pod_coordinator=pod_coord, slice_coordinator=slice_coord,
        targets=targets, seed=seed, codec=codec, fault=fault)
    refs = {s.run.remote(spec, slice_devices, timeout_s): f"decode{q}"
            for q, (s, spec) in enumerate(zip(slices, slice_specs))}
    refs.update({a.run.remote(spec, pod_devices, timeout_s): f"prefill{p}"
                 for p, (a, spec) in enumerate(zip(pods, pod_specs))})
    reports: dict[str, dict] = {}
    pending = list(refs)
    while pending:
      done, pending = ray.wait(pending, num_returns=1,
                               timeout=max(0.0, deadline - time.monotonic()))
      if not done:
        raise PodFailure(grpc.StatusCode.DEADLINE_EXCEEDED, refs[pending[0]], None,
                         f"{sorted(refs[r] for r in pending)} still running at the deadline",
                         sorted(reports))
      try:
        reports[refs[done[0]]] = ray.get(done[0])
      except ray.exceptions.RayError as e:
        # The first failure stops the rest (finally: every actor and its process).
        raise _failure(e, refs[done[0]], sorted(reports)) from None
    return LocalRun([reports[f"prefill{p}"] for p in range(pod_processes)],
                    [reports[f"decode{q}"] for q in range(slice_processes)],
                    time.monotonic() - t0)
  finally:
    for a in actors:
      ray.kill(a, no_restart=True)
    for g in groups:
      remove_placement_group(g)
