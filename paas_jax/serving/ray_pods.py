"""A prefill pod or a decode slice under Ray: one actor per process (#16).

``RayCluster`` (ray_launch.py) hands the command line LocalCluster would give
a region's local supervisor (``pod_prefill_server`` / ``slice_decode_server``
without ``--<kind>_process_id``) to a ``RegionGroup``. Instead of running that
supervisor, which would put every process on one node, the group starts each
process in the per-process mode (``--<kind>_process_id=p
--<kind>_coordinator=<process 0's node>:<port>``) as its own ``ServerProcess``
actor, process ``p`` in bundle ``p`` of the region's placement group (so the
whole pod is gang-scheduled, packed or spread by ``RayPlacement``'s strategy).
Process 0 serves the ports the broker dials; a slice's processes also each
serve a StateTransfer port and a TCP data plane on ports fixed at the first
start, as ``pod_supervisor`` fixes them, so a restarted slice is reached where
the pod and the relay expect it.

The pod is one program: a monitor thread waits on every process. When one
exits (or its actor dies), every other process is stopped at once -- the
survivors would otherwise wait in a collective or the coordinator's key-value
store -- and the whole pod starts again (new actors in the same bundles, the
same ports, a fresh coordinator port on process 0's node, without the one-shot
fault plan), up to ``RayPlacement.max_restarts`` times; the broker's health
checks take it back when process 0 serves again.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import threading
import time
from typing import Sequence

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paas_jax.serving.child_process import LaunchError
from paas_jax.serving.pod_supervisor import RegionProcesses, passed_on
from paas_jax.serving.ports import free_port

log = logging.getLogger("paas_jax.serving.ray_pods")

# The multi-process servers and their kind (the prefix of their region flags).
MODULES = {"paas_jax.serving.pod_prefill_server": "pod",
           "paas_jax.serving.slice_decode_server": "slice"}


def _flag_values(args: Sequence[str]) -> dict[str, str]:
  """``--name=value`` flags of a command line (the last one wins, as in absl)."""
  return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def region_of(args: Sequence[str], max_restarts: int = 3) -> RegionProcesses | None:
  """The processes a pod/slice supervisor command line (``-m <module> ...``)
  would start; None for any other server. Raises ValueError for a command line
  that is already one process's, or a region of fewer than one process."""
  if len(args) < 2 or args[0] != "-m" or args[1] not in MODULES:
    return None
  kind = MODULES[args[1]]
  flags = _flag_values(args)
  if int(flags.get(f"--{kind}_process_id", "-1")) >= 0:
    raise ValueError(f"{args[1]} is already one process's command line "
                     f"(--{kind}_process_id={flags[f'--{kind}_process_id']})")
  processes, devices = int(flags.get(f"--{kind}_processes", 2)), int(flags.get(
      f"--{kind}_devices", 1))
  if processes < 1 or devices < 1:
    raise ValueError(f"--{kind}_processes ({processes}) and --{kind}_devices ({devices}) "
                     "must be >= 1")
  slice_ = kind == "slice"  # every slice process receives: its own transfer port and plane
  return RegionProcesses(module=args[1], kind=kind, processes=processes, devices=devices,
                         fault=flags.get(f"--{kind}_fault", ""), max_restarts=max_restarts,
                         own_transfer_ports=slice_,
                         own_data_plane_ports=slice_ and flags.get("--transfer_plane",
                                                                  "tcp") == "tcp")


def process_args(args: Sequence[str], region: RegionProcesses, process_id: int, *,
                 coordinator: str, host: str, port: int, transfer_port: int | None,
                 data_plane_port: int | None = None, data_plane_host: str | None = None,
                 first: bool = True) -> list[str]:
  """Process ``process_id``'s command line, from its supervisor's (pure): the
  supervisor's per-process flags replaced as ``pod_supervisor._Pod`` sets them,
  ``--host`` its own node's address, ``--data_plane_host`` replaced by
  ``data_plane_host`` when given, the fault plan only in the first
  incarnation (``first``). Raises ValueError for a process outside the region, a
  coordinator that is not host:port, or a port the process needs left out."""
  if not 0 <= process_id < region.processes:
    raise ValueError(f"process {process_id} is outside the {region.kind} of "
                     f"{region.processes} processes")
  chost, _, cport = coordinator.rpartition(":")
  if not chost or not cport.isdigit() or not 0 < int(cport) < 65536:
    raise ValueError(f"coordinator must be host:port, got {coordinator!r}")
  needs_transfer = process_id == 0 or region.own_transfer_ports
  if needs_transfer and transfer_port is None:
    raise ValueError(f"{region.kind} process {process_id} serves a StateTransfer port: "
                     "transfer_port is required")
  if region.own_data_plane_ports and not data_plane_port:
    raise ValueError(f"{region.kind} process {process_id} serves a TCP data plane on a "
                     "fixed port: data_plane_port is required")
  kind = region.kind
  replaced = ("--host",) + (("--data_plane_host",) if data_plane_host else ())
  out = ["-m", region.module,
         *[a for a in passed_on(args[2:], region) if a.split("=", 1)[0] not in replaced],
         f"--host={host}", f"--{kind}_process_id={process_id}",
         f"--{kind}_coordinator={coordinator}"]
  if data_plane_host:
    out.append(f"--data_plane_host={data_plane_host}")
  if process_id == 0:
    out.append(f"--port={port}")
  if needs_transfer:
    out.append(f"--transfer_port={transfer_port}")
  if region.own_data_plane_ports:
    out.append(f"--data_plane_port={data_plane_port}")
  if first and region.fault:
    out.append(f"--{kind}_fault={region.fault}")
  return out


def process_env(region: RegionProcesses) -> dict[str, str]:
  """Environment of each process: its devices (on CPU, as the supervisor sets them)."""
  return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={region.devices}"}


@ray.remote(num_cpus=0)
def _free_port() -> int:
  """A free port on the node this runs on (a bundle's node), below the ephemeral
  range: it is announced to the slice before its owner binds it."""
  return free_port("")


def bundle_nodes(group) -> list[str]:
  """The node id of each bundle of a placed group, by bundle index."""
  table = placement_group_table(group)["bundles_to_node_id"]
  return [table[i] for i in range(len(table))]


def node_ips() -> dict[str, str]:
  return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def _ports_on(group, indexes: Sequence[int]) -> list[int]:
  refs = [_free_port.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
      group, placement_group_bundle_index=i)).remote() for i in indexes]
  return ray.get(refs, timeout=120)


def relayed_data_plane_hosts(name: str, nodes: Sequence[str], hosts: Sequence[str],
                             relay_bind: str | None) -> list[str | None]:
  """Where each process of a region binds its TCP data plane behind a relay (pure).

  The relay runs on the node of process 0 and listens, at the address region
  A dials (that node's, ``hosts[0]``), on each data plane's announced port. So
  a process on that node binds on ``relay_bind`` (another loopback address, as
  on one host), and a process on another node binds on its own node's address,
  where the relay forwards to it. ``[None] * n`` without a relay (each keeps
  its supervisor's flags). Raises LaunchError when another node has process
  0's address: its data plane would bind the very address and port the relay
  listens on.
  """
  if not relay_bind:
    return [None] * len(nodes)
  clash = sorted({h for n, h in zip(nodes, hosts) if n != nodes[0] and h == hosts[0]})
  if clash:
    raise LaunchError(f"{name}: a node of this {len(nodes)}-process group has the address "
                      f"{clash[0]} of process 0's node, where the relay listens on every "
                      "data plane's port; give each node its own address "
                      "(ray start --node-ip-address)")
  return [relay_bind if n == nodes[0] else h for n, h in zip(nodes, hosts)]


class _GroupPopen:
  """``Popen``'s slice LocalCluster uses, on the pod's process 0 (the one that
  serves); any process's death restarts the whole pod (the monitor)."""

  def __init__(self, group: "RegionGroup"):
    self._group = group
    self.returncode: int | None = None

  def _call(self, method: str, *args, timeout: float | None = 30):
    try:
      return ray.get(getattr(self._group.members[0], method).remote(*args), timeout=timeout)
    except ray.exceptions.RayActorError:
      return -signal.SIGKILL

  def poll(self) -> int | None:
    self.returncode = self._call("poll")
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    self.returncode = self._call("wait", timeout, timeout=None)
    if self.returncode is None:
      raise subprocess.TimeoutExpired(self._group.name, timeout)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    self._call("signal", int(signum))

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class RegionGroup:
  """A pod's (or slice's) processes as actors; quacks like ray_launch.RayProc."""

  def __init__(self, cluster, name: str, args: Sequence[str], region: RegionProcesses,
               group, actor_cls, resources: dict, previous: "RegionGroup | None" = None):
    self.name, self.args, self.prefix = name, tuple(args), ()
    self.region, self.group = region, group
    self._cluster, self._actor_cls, self._resources = cluster, actor_cls, dict(resources)
    nodes, ips = bundle_nodes(group), node_ips()
    if len(nodes) < region.processes:
      raise LaunchError(f"{name}: its placement group has {len(nodes)} bundles for "
                        f"{region.processes} processes")
    self.nodes = nodes[:region.processes]
    self.hosts = [ips[n] for n in self.nodes]
    flags = _flag_values(args)
    self.data_plane_hosts = relayed_data_plane_hosts(
        name, self.nodes, self.hosts, flags.get("--data_plane_host"))
    self.port = int(flags.get("--port", 0))
    # Fixed for the region's lifetime (pod_supervisor), also across
    # LocalCluster.restart (``previous``): a restart is reached where the broker,
    # the prefill pod and the relay expect it.
    if isinstance(previous, RegionGroup) and previous.region == region:
      others, self.data_plane_ports = previous.transfer_ports[1:], previous.data_plane_ports
    else:
      others = ((_ports_on(group, range(1, region.processes)) if region.own_transfer_ports
                 else [None] * (region.processes - 1)))
      self.data_plane_ports = (_ports_on(group, range(region.processes))
                               if region.own_data_plane_ports else [None] * region.processes)
    self.transfer_ports = [int(flags.get("--transfer_port", 0))] + list(others)
    self.info: dict = {}
    self.restarts = 0
    self.failures: list[dict] = []
    self.gave_up = False
    self.members: list = []
    self._watch: list = []
    self._ready_ref = None
    self._stopping = threading.Event()
    self._lock = threading.Lock()
    self._monitor: threading.Thread | None = None
    self.popen = _GroupPopen(self)
    self._start(first=True)

  # -- one incarnation ------------------------------------------------------------

  def _start(self, first: bool) -> None:
    r, c = self.region, self._cluster
    coordinator = f"{self.hosts[0]}:{_ports_on(self.group, [0])[0]}"
    members = []
    for p in range(r.processes):
      args = process_args(self.args, r, p, coordinator=coordinator, host=self.hosts[p],
                          port=self.port, transfer_port=self.transfer_ports[p],
                          data_plane_port=self.data_plane_ports[p],
                          data_plane_host=self.data_plane_hosts[p], first=first)
      res = dict(self._resources)
      members.append(self._actor_cls.options(
          name=f"paas-{c.cluster_id}-{self.name}.{p}-{self.restarts}",
          num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0), resources=res,
          max_restarts=0,  # the pod restarts as a unit (the monitor), never one process
          max_concurrency=8,
          scheduling_strategy=PlacementGroupSchedulingStrategy(
              self.group, placement_group_bundle_index=p)).remote(
                  f"{self.name}.{p}", args, str(c.workdir), c._cert_files(),  # pylint: disable=protected-access
                  process_env(r)))
    with self._lock:
      self.members = members
      self._watch = [m.wait.remote(None) for m in members]
      self._ready_ref = members[0].ready.remote(c.spec.startup_timeout_s)
    log.warning("%s incarnation %d: %d actors, coordinator %s", self.name, self.restarts,
                len(members), coordinator)

  def _check_ready(self) -> dict | None:
    """Process 0's ready info once it serves; raises LaunchError if a process
    of this incarnation exited (or its actor died) first."""
    done, _ = ray.wait([self._ready_ref], timeout=0)
    if not done:
      gone, _ = ray.wait(self._watch, timeout=0)
      if not gone:
        return None
      p = self._watch.index(gone[0])
      raise LaunchError(f"{self.name} process {p} exited before the {self.region.kind} "
                        f"served; last log lines:\n{self._log_tail(p)}")
    try:
      info = ray.get(self._ready_ref)
    except ray.exceptions.RayError as e:
      raise LaunchError(f"{self.name} process 0 failed before it served: {e}; last log "
                        f"lines:\n{self._log_tail(0)}") from None
    where = ray.get([m.where.remote() for m in self.members], timeout=60)
    self.port = info["port"]
    self.transfer_ports[0] = info["transfer_port"]
    return dict(info, restarts=self.restarts, processes=where,
                placement_group=self.group.id.hex(), failures=list(self.failures))

  def _stop_members(self) -> None:
    """Stops every process of the incarnation (a broken pod's survivors included)."""
    refs = [m.stop.remote(5.0) for m in self.members]
    ray.wait(refs, num_returns=len(refs), timeout=30)
    for m in self.members:
      try:
        ray.kill(m, no_restart=True)
      except Exception:  # pylint: disable=broad-except  (already gone)
        pass

  # -- RayProc's interface ----------------------------------------------------------

  def poll_ready(self) -> bool:
    if self.info:
      return True
    info = self._check_ready()
    if info is None:
      return False
    self.info = info
    self._monitor = threading.Thread(target=self._supervise, name=f"monitor-{self.name}",
                                     daemon=True)
    self._monitor.start()
    return True

  def _supervise(self) -> None:
    """Restarts the whole region when any of its processes exits."""
    while not self._stopping.is_set():
      gone, _ = ray.wait(self._watch, timeout=0.5)
      if not gone or self._stopping.is_set():
        continue
      p = self._watch.index(gone[0])
      try:
        rc = ray.get(gone[0], timeout=5)
      except ray.exceptions.RayError:
        rc = None  # its actor died (killed, or its node went)
      self.failures.append({"incarnation": self.restarts, "process": p, "returncode": rc,
                            "at": time.time()})
      log.error("%s process %d exited (%s): stopping and restarting all %d processes",
                self.name, p, rc, self.region.processes)
      self._stop_members()
      if self.restarts >= self.region.max_restarts:
        log.error("%s gave up after %d restarts: %s", self.name, self.restarts, self.failures)
        self.gave_up = True
        return
      self.restarts += 1
      self._start(first=False)
      deadline = time.monotonic() + self._cluster.spec.startup_timeout_s
      while not self._stopping.is_set():
        try:
          info = self._check_ready()
        except LaunchError as e:
          log.error("%s incarnation %d failed: %s", self.name, self.restarts, e)
          break  # the next loop sees the exited process and restarts again
        if info is not None:
          self.info = info
          break
        if time.monotonic() > deadline:
          log.error("%s incarnation %d not ready in time", self.name, self.restarts)
          self._stop_members()
          break
        time.sleep(0.2)

  def wait_restarted(self, before: int, timeout_s: float) -> dict:
    """Blocks until an incarnation after ``before`` restarts serves; its info."""
    deadline = time.monotonic() + timeout_s
    while self.info.get("restarts", 0) <= before:
      if self.gave_up or time.monotonic() > deadline:
        raise LaunchError(f"{self.name} did not come back within {timeout_s:.0f} s "
                          f"(failures: {self.failures})")
      time.sleep(0.2)
    return self.info

  def kill_process(self, process_id: int, *, actor: bool = False) -> None:
    """SIGKILLs one process (``actor``: its actor, the process with it): a lost machine."""
    member = self.members[process_id]
    if actor:
      ray.kill(member, no_restart=True)
    else:
      ray.get(member.signal.remote(int(signal.SIGKILL)), timeout=30)

  def where(self) -> list[dict]:
    return ray.get([m.where.remote() for m in self.members], timeout=60)

  def _log_tail(self, p: int, lines: int = 30) -> str:
    try:
      return ray.get(self.members[p].log_tail.remote(lines), timeout=30)
    except ray.exceptions.RayError:
      return ""

  def log_tail(self, lines: int = 30) -> str:
    return "\n".join(f"[{self.name}.{p}] {self._log_tail(p, lines)}"
                     for p in range(len(self.members)))

  def stop(self, timeout_s: float = 10.0) -> None:
    del timeout_s  # each process gets 5 s to stop, all at once
    self._stopping.set()
    if self._monitor is not None and self._monitor is not threading.current_thread():
      self._monitor.join(60)
    self._stop_members()


@dataclasses.dataclass(frozen=True)
class GroupLayout:
  """The bundles of a cluster's pod (region A) and slice (region B) groups:
  ``slice`` processes in each of ``slices`` slice groups (PD nodes 0 ..
  ``slices`` - 1)."""

  pod: int
  slice: int
  slices: int = 0


def layout_of(spec) -> GroupLayout:
  """A prefill pod's processes fill region A's group; each decode slice's its
  own region-B group (the slices are PD nodes 0 .. ``slice_nodes`` - 1, the
  other PD nodes in region B's)."""
  sliced = spec.decode_slice > 1
  return GroupLayout(pod=max(1, spec.prefill_pod), slice=spec.decode_slice if sliced else 0,
                     slices=spec.slice_nodes if sliced else 0)


def slice_group(node: int) -> str:
  """The placement-group key of PD node ``node``'s slice."""
  return "b-slice" if node == 0 else f"b-slice{node}"


def slice_node_of(name: str) -> int:
  """The PD node a slice server's name (``decode``, ``decode1``, ...) is."""
  base = name.rsplit(".", 1)[-1]
  suffix = base[len("decode"):] if base.startswith("decode") else None
  if suffix is None or not (suffix == "" or suffix.isdigit()):
    raise ValueError(f"{name!r} is not a PD node's name (decode, decode1, ...)")
  return int(suffix or 0)
