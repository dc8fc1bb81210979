"""Places the two-region deployment on a Ray cluster (the same ``ClusterSpec``).

``RayCluster`` is ``LocalCluster`` with another placement: each process (the
region-A prefill server, region B's PD nodes, the WAN relay, the broker) is a
subprocess supervised by a ``ServerProcess`` Ray actor.

  region A   one placement group, bundles need the custom resource ``region_a``
             (a bundle and actor per pod process, ray_pods.py; all placed or none)
  region B   one STRICT_PACK placement group on a ``region_b`` node: PD nodes,
             relay (the emulated link sits at region B's edge), broker, gateway;
             a decode slice in its own group, an actor per process (ray_pods.py)

``RayPlacement.address=None`` starts a local one-node Ray with every region's
resource (``ray.init()``); ``address="host:6379"`` (``--ray_address``) joins
an existing cluster whose nodes were started with e.g.
``ray start --resources='{"region_a": 1}'``.

Failures: when a server process dies, its actor exits and Ray restarts it
(``max_restarts``); the new actor starts the server again on the same ports
(pinned in a file on its node) without the one-shot ``--faults`` plan, and the
broker's health checks see it come back. Killing an actor kills its process
too (``PR_SET_PDEATHSIG``). Certificates and tokens travel with each actor
(its bytes, written to the same path on its node), so mutual TLS stays on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Sequence

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paas_jax.serving.child_process import LaunchError, set_parent_death_signal, stop_process
from paas_jax.serving.common import write_text_atomic
from paas_jax.serving import ray_pods
from paas_jax.serving.launch import ClusterSpec, LocalCluster

REPO = pathlib.Path(__file__).resolve().parents[2]
# Each process takes this much of its region's custom resource, so that a node
# started with ``region_a: 1`` holds up to 100 of them.
REGION_SHARE = 0.01
# Pinned ports of a restarted server (first value of each flag kept as is).
_PINNED_FLAGS = ("--port", "--transfer_port")


@dataclasses.dataclass(frozen=True)
class RayPlacement:
  """Where and how the processes run on Ray."""

  address: str | None = None  # None: start a local Ray; "auto" or "host:port": join
  region_a_resource: str = "region_a"
  region_b_resource: str = "region_b"  # further decode regions: region_c, region_d, ...
  cpus_per_server: float = 1.0  # logical CPUs per prefill/decode server (0: none)
  gpus_per_server: float = 0.0
  max_restarts: int = 3
  region_a_strategy: str = "PACK"  # a pod across several nodes: SPREAD
  region_b_slice_strategy: str = "PACK"  # a decode slice's group (region B): likewise
  namespace: str = "paas_jax"
  placement_timeout_s: float = 120.0
  # A local Ray started by this launcher (address=None): small footprint.
  local_num_cpus: int = 8
  local_object_store_bytes: int = 80 * 1024 * 1024


def restart_args(args: Sequence[str], pins: dict) -> list[str]:
  """A restarted server's arguments: the ports it served on (``pins``, e.g.
  ``{"--port": 5001}``) instead of 0, and no ``--faults`` plan (a fault plan is a
  one-shot injection; the restarted server comes back healthy)."""
  out = []
  for a in args:
    key = a.split("=", 1)[0]
    if key == "--faults":
      continue
    out.append(f"{key}={pins[key]}" if pins.get(key) else a)
  return out


@ray.remote
class ServerProcess:
  """One server process on a Ray node (see the module docstring)."""

  def __init__(self, name: str, args: Sequence[str], workdir: str,
               files: dict[str, bytes], env: dict[str, str]):
    self.name = name
    self.workdir = pathlib.Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():  # certificates and tokens, same paths as the driver's
      path = self.workdir / rel
      path.parent.mkdir(parents=True, exist_ok=True)
      if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
        path.chmod(0o600)
    self.pins_file = self.workdir / f"{name}.pins.json"
    self.ready_file = self.workdir / f"{name}.ready.json"
    self.log_file = self.workdir / f"{name}.log"
    restarts_file = self.workdir / f"{name}.restarts"
    self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
    self.restarts = 0
    args = list(args)
    if self.restarted:
      self.restarts = int(restarts_file.read_text()) + 1 if restarts_file.exists() else 1
      pins = json.loads(self.pins_file.read_text()) if self.pins_file.exists() else {}
      args = restart_args(args, pins)
    # Atomic: the actor may be killed at any moment, and its restart reads these.
    write_text_atomic(restarts_file, str(self.restarts))
    self.ready_file.unlink(missing_ok=True)
    self.info: dict = {}
    self.returncode: int | None = None
    self.stopping = False
    self.exited = threading.Event()
    child_env = dict(os.environ)
    child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    started = threading.Event()
    self.popen: subprocess.Popen | None = None
    self.spawn_error: BaseException | None = None
    # The supervising thread lives exactly as long as the child: PDEATHSIG fires
    # when the thread that forked it ends, i.e. when this actor's process dies.
    threading.Thread(target=self._supervise, args=(args, child_env, started),
                     name=f"supervise-{name}", daemon=True).start()
    started.wait()
    if self.spawn_error is not None:
      raise LaunchError(f"{name}: could not start: {self.spawn_error}")

  def _supervise(self, args, env, started) -> None:
    try:
      with open(self.log_file, "a") as log:
        self.popen = subprocess.Popen(
            [sys.executable, *args, f"--ready_file={self.ready_file}"], stdout=log,
            stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
            preexec_fn=set_parent_death_signal)  # pylint: disable=subprocess-popen-preexec-fn
    except OSError as e:
      self.spawn_error = e
      started.set()
      return
    started.set()
    self.returncode = self.popen.wait()
    self.exited.set()
    if not self.stopping and self.info:
      # It died after it served: exit so that Ray restarts this actor (max_restarts).
      # The pause lets a caller blocked in wait() receive the exit status first.
      time.sleep(0.5)
      os._exit(1)

  def ready(self, timeout_s: float) -> dict:
    """Blocks until the server wrote its ready file; returns it plus where it runs."""
    if self.exited.is_set() and self.info:
      time.sleep(30)  # died after serving: this actor exits within 0.5 s (a restart)
    deadline = time.monotonic() + timeout_s
    while not self.ready_file.exists():
      if self.exited.is_set():
        raise LaunchError(f"{self.name} exited with {self.returncode} before it was "
                          f"ready; last log lines:\n{self.log_tail()}")
      if time.monotonic() > deadline:
        raise LaunchError(f"{self.name} not ready after {timeout_s:.0f} s")
      time.sleep(0.1)
    info = json.loads(self.ready_file.read_text())
    write_text_atomic(self.pins_file,
                      json.dumps({k: info.get(k.lstrip("-")) for k in _PINNED_FLAGS}))
    self.info = info
    return dict(info, **self.where())

  def where(self) -> dict:
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "actor_pid": os.getpid(),
            "pid": self.popen.pid if self.popen else None, "restarts": self.restarts}

  def poll(self) -> int | None:
    return self.returncode

  def wait(self, timeout_s: float | None) -> int | None:
    self.exited.wait(timeout_s)
    return self.returncode

  def signal(self, signum: int) -> None:
    if self.popen is not None and self.returncode is None:
      self.popen.send_signal(signum)

  def stop(self, timeout_s: float = 10.0) -> int | None:
    self.stopping = True
    if self.popen is not None:
      stop_process(self.popen, timeout_s)
    return self.popen.returncode if self.popen else None

  def log_tail(self, lines: int = 30) -> str:
    try:
      return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
      return ""

  def read_file(self, path: str) -> bytes | None:
    """A file this node wrote (the relay's statistics)."""
    try:
      return pathlib.Path(path).read_bytes()
    except OSError:
      return None


def _get(ref, timeout_s: float | None = None):
  """ray.get, with an actor's LaunchError re-raised as itself."""
  try:
    return ray.get(ref, timeout=timeout_s)
  except ray.exceptions.RayTaskError as e:
    cause = e.as_instanceof_cause()
    if isinstance(cause, LaunchError):
      raise LaunchError(str(cause).split("\n", 1)[-1]) from None
    raise


class _ActorPopen:
  """The slice of ``subprocess.Popen`` that LocalCluster and the demo use."""

  def __init__(self, proc: "RayProc"):
    self._proc = proc
    self.returncode: int | None = None

  def poll(self) -> int | None:
    try:
      self.returncode = _get(self._proc.actor.poll.remote(), 30)
    except ray.exceptions.RayActorError:
      self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    try:
      self.returncode = _get(self._proc.actor.wait.remote(timeout), None)
    except ray.exceptions.RayActorError:  # the actor went with its process
      self.returncode = -signal.SIGKILL
    if self.returncode is None:
      raise subprocess.TimeoutExpired(self._proc.name, timeout)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    _get(self._proc.actor.signal.remote(int(signum)), 30)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


@dataclasses.dataclass
class RayProc:
  """A server process under a ServerProcess actor (LocalCluster's ``Proc``)."""

  name: str
  actor: "ray.actor.ActorHandle"
  ready_ref: "ray.ObjectRef"
  bundle: tuple[str, int]
  info: dict = dataclasses.field(default_factory=dict)
  args: tuple = ()
  prefix: tuple = ()

  def __post_init__(self):
    self.popen = _ActorPopen(self)

  def poll_ready(self) -> bool:
    if self.info:
      return True
    done, _ = ray.wait([self.ready_ref], timeout=0)
    if not done:
      return False
    try:
      self.info = _get(self.ready_ref)
    except ray.exceptions.RayActorError as e:
      raise LaunchError(f"{self.name}'s actor died before it was ready: {e}") from None
    return True

  def where(self) -> dict:
    return _get(self.actor.where.remote(), 30)

  def log_tail(self, lines: int = 30) -> str:
    try:
      return _get(self.actor.log_tail.remote(lines), 30)
    except ray.exceptions.RayError:
      return ""

  def stop(self, timeout_s: float = 10.0) -> None:
    try:
      _get(self.actor.stop.remote(timeout_s), timeout_s + 20)
    except (ray.exceptions.RayError, LaunchError):
      pass
    ray.kill(self.actor, no_restart=True)


class RayCluster(LocalCluster):
  """``LocalCluster`` whose processes Ray places (see the module docstring)."""

  def __init__(self, spec: ClusterSpec, workdir=None, placement: RayPlacement = RayPlacement()):
    super().__init__(spec, workdir)
    self.workdir = self.workdir.resolve()  # the same path on every node
    self.relay_stats_file = self.workdir / "relay_stats.json"
    self.placement = placement
    self.cluster_id = uuid.uuid4().hex[:8]
    self.groups: dict[str, object] = {}
    self.nodes: dict[str, str] = {}  # region -> Ray node id
    self._bundles: dict[str, tuple[str, int]] = {}
    self._next_bundle: dict[str, int] = {}
    self._started_ray = False
    self._relay_stats_at_stop: dict[str, dict | None] = {}

  # -- placement ------------------------------------------------------------------

  def resource_of(self, region: str) -> str:
    """The custom resource that marks region ``region``'s nodes."""
    p = self.placement
    return {"a": p.region_a_resource, "b": p.region_b_resource}.get(region, f"region_{region}")

  def _decode_region_processes(self, region: str) -> int:
    return (self.spec.pd_nodes + (self.link_of(region) is not None) + 1
            + (self.spec.http and region == "b"))

  def _bundle(self, region: str, server: bool) -> dict:
    p = self.placement
    res = {self.resource_of(region): REGION_SHARE}
    if server and p.cpus_per_server:
      res["CPU"] = p.cpus_per_server
    if server and p.gpus_per_server:
      res["GPU"] = p.gpus_per_server
    return res

  def _place(self) -> tuple[str, str]:
    spec, p = self.spec, self.placement
    if spec.netem == "netns" and spec.link is not None:
      raise LaunchError("netem='netns' needs one host; on Ray use the relay")
    if spec.flaky_wan:
      raise LaunchError("flaky_wan runs in the launcher's process; not on Ray")
    if not ray.is_initialized():
      if p.address:
        ray.init(address=p.address, namespace=p.namespace, log_to_driver=False)
      else:
        ray.init(num_cpus=p.local_num_cpus, namespace=p.namespace, include_dashboard=False,
                 object_store_memory=p.local_object_store_bytes, log_to_driver=False,
                 resources={self.resource_of(r): 1 for r in ["a", *self.decode_regions]})
      self._started_ray = True
    # Region A: one bundle per prefill pod process (ray_pods: one actor each).
    layout = ray_pods.layout_of(spec)
    self.groups["a"] = placement_group([self._bundle("a", True)] * layout.pod,
                                       strategy=p.region_a_strategy,
                                       name=f"paas-{self.cluster_id}-region-a")
    # Each slice (PD nodes 0 .. slices - 1) in its own group, every process 0 on
    # the node of the first one's, and region B's other processes beside them:
    # the broker and the relay reach every PD node on region B's address.
    target = None
    for node in range(layout.slices):
      key = ray_pods.slice_group(node)
      # Process 0 of a later slice on the first one's node (a Ray node-id label).
      pin = None if target is None else [{NODE_ID_LABEL_KEY: target}] + [{}] * (layout.slice - 1)
      self.groups[key] = placement_group(
          [self._bundle("b", True)] * layout.slice, strategy=p.region_b_slice_strategy,
          name=f"paas-{self.cluster_id}-region-{key}", bundle_label_selector=pin)
      self._wait_placed(key, self.groups[key])
      target = target or ray_pods.bundle_nodes(self.groups[key])[0]
    for region in self.decode_regions:
      servers = spec.pd_nodes - (layout.slices if region == "b" else 0)
      bundles = [self._bundle(region, True)] * servers + [
          self._bundle(region, False)] * (self._decode_region_processes(region) - spec.pd_nodes)
      self.groups[region] = placement_group(
          bundles, strategy="STRICT_PACK", name=f"paas-{self.cluster_id}-region-{region}",
          _soft_target_node_id=target if region == "b" else None)
    for region, group in self.groups.items():
      self._wait_placed(region, group)
      # Bundle 0 is a pod's (a slice's) process 0: the node that serves its ports.
      self.nodes[region] = ray_pods.bundle_nodes(group)[0]
    slice_keys = [ray_pods.slice_group(n) for n in range(layout.slices)]
    apart = [k for k in slice_keys if self.nodes[k] != self.nodes["b"]]
    if apart:
      raise LaunchError(f"region B's processes and the process 0 of {', '.join(apart)} were "
                        "placed on different nodes; the broker dials every slice on region "
                        "B's node")
    for key in slice_keys:
      self.nodes.pop(key)
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    self.a_host = ips[self.nodes["a"]]
    # A decode region's processes bind and are dialled on its node's address.
    self.region_hosts = {r: (ips[self.nodes[r]],) * 2 for r in self.decode_regions}
    return self.a_host, self.b_local

  def _wait_placed(self, region: str, group) -> None:
    p = self.placement
    ready, _ = ray.wait([group.ready()], timeout=p.placement_timeout_s)
    if not ready:
      raise LaunchError(
          f"region {region.upper()}'s placement group {group.bundle_specs} was not placed "
          f"within {p.placement_timeout_s:.0f} s: does a node have the resources? "
          f"(cluster: {ray.cluster_resources()})")

  def _make_certs(self, a_host: str, b_host: str) -> None:
    # A pod's or slice's processes serve on their own nodes: every node's address.
    hosts = self.region_hosts
    self.region_hosts = dict(hosts, **{f"node {ip}": (ip, ip)
                                       for ip in ray_pods.node_ips().values()})
    try:
      super()._make_certs(a_host, b_host)
    finally:
      self.region_hosts = hosts

  def _cert_files(self) -> dict[str, bytes]:
    if self.certs is None:
      return {}
    return {str(f.relative_to(self.workdir)): f.read_bytes()
            for f in sorted(self.certs.iterdir()) if f.is_file()}

  def _spawn(self, name: str, args: Sequence[str], region: str,
             prefix: Sequence[str] = ()) -> RayProc:
    if prefix:
      raise LaunchError("exec prefixes (network namespaces) are not supported on Ray")
    try:
      region_procs = ray_pods.region_of(args, self.placement.max_restarts)
    except ValueError as e:
      raise LaunchError(f"{name}: {e}") from None
    if region_procs is not None:  # a pod / slice: one actor per process (ray_pods)
      group = self.groups[ray_pods.slice_group(ray_pods.slice_node_of(name))
                          if region_procs.kind == "slice" else region]
      return ray_pods.RegionGroup(self, name, args, region_procs, group, ServerProcess,
                                  self._bundle(region, True), previous=self.procs.get(name))
    if name in self._bundles:  # a restart goes back to its bundle
      region, index = self._bundles[name]
    else:
      index = self._next_bundle.get(region, 0)
      self._next_bundle[region] = index + 1
      self._bundles[name] = (region, index)
    server = name == "prefill" or name.rsplit(".", 1)[-1].startswith("decode")
    res = self._bundle(region, server)
    actor = ServerProcess.options(
        name=f"paas-{self.cluster_id}-{name}", num_cpus=res.pop("CPU", 0),
        num_gpus=res.pop("GPU", 0), resources=res, max_restarts=self.placement.max_restarts,
        max_concurrency=8,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.groups[region], placement_group_bundle_index=index)).remote(
                name, list(args), str(self.workdir), self._cert_files(), {})
    ready = actor.ready.remote(self.spec.startup_timeout_s)
    return RayProc(name, actor, ready, (region, index), args=tuple(args))

  # -- lifecycle ------------------------------------------------------------------

  def stop(self) -> None:
    for region in self.decode_regions:
      if self.procs.get(self._name(region, "relay")) is not None:
        self._relay_stats_at_stop.setdefault(region, self.relay_stats(region))
    try:
      super().stop()
    finally:
      for group in self.groups.values():
        try:
          remove_placement_group(group)
        except Exception:  # pylint: disable=broad-except
          pass  # Ray already gone
      self.groups.clear()
      if self._started_ray and ray.is_initialized():
        ray.shutdown()
        self._started_ray = False

  def relay_stats(self, region: str = "b") -> dict | None:
    """A decode region's relay statistics, read on its node (after ``stop``:
    the last ones read before the relay stopped)."""
    relay = self.procs.get(self._name(region, "relay"))
    if relay is None or region in self._relay_stats_at_stop:
      return self._relay_stats_at_stop.get(region)
    try:
      data = _get(relay.actor.read_file.remote(str(self.relay_stats_path(region))), 30)
    except Exception:  # pylint: disable=broad-except
      return None  # actor gone: Ray raises plain Exceptions on submission too
    return None if data is None else json.loads(data)

  def wait_restarted(self, name: str, timeout_s: float = 300.0) -> dict:
    """After a crash: blocks until ``name``'s actor has restarted (its restart
    count is above the one in ``procs[name].info``) and serves again."""
    proc = self.procs[name]
    before = proc.info.get("restarts", 0)
    if isinstance(proc, ray_pods.RegionGroup):  # restarted as a unit by its monitor
      return proc.wait_restarted(before, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
      left = max(1.0, deadline - time.monotonic())
      try:
        info = _get(proc.actor.ready.remote(left), left + 30)
        if info["restarts"] > before:
          proc.info = info
          return info
      except ray.exceptions.RayActorError:
        pass  # the old actor's process is going or the new one not up yet
      if time.monotonic() > deadline:
        raise LaunchError(f"{name} did not come back within {timeout_s:.0f} s")
      time.sleep(0.5)
