"""Starts a two-region deployment as separate OS processes (demo and tests).

  region A  : prefill server (PrfaaS)       python -m paas_jax.serving.prefill_server
  region B  : decode server (PD-D + PD-P)   python -m paas_jax.serving.decode_server
  WAN link  : relay between A and B         python -m paas_jax.netem
  front door: broker                        python -m paas_jax.serving.broker

The link carries the state transfers (A -> B), the broker's control calls
to region A (B -> A) and cross-cluster prefix transfers both ways (region A's
prefixes on the states' route, PD-P's to region A's prefix port, B -> A). With ``netem="netns"`` region A runs in its own network
namespace with tbf bandwidth shaping; the relay then adds only RTT and jitter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
import time
from typing import Sequence

import grpc

from paas_jax.netem.link import LinkSpec
from paas_jax.netem.netns import NetnsLink
from paas_jax.netem.splice_relay import default_engine
from paas_jax.security import TLSConfig, channel_credentials
from paas_jax.security import ca as ca_lib
from paas_jax.security.auth import write_token_files
from paas_jax.security.faults import FlakyLinks
from paas_jax.serving import launch_args, launch_routes
from paas_jax.serving.child_process import LaunchError, Proc, spawn, wait_ready

# Loopback address PD nodes bind their data plane on when a WAN relay sits in front
# (the relay takes the announced port on the address region A dials).
_DATA_PLANE_HOST = "127.0.0.3"


@dataclasses.dataclass
class ClusterSpec:
  """What to start. ``link=None``: no WAN emulation (regions talk directly)."""

  config: str = "tiny_gdn_gqa"
  seed: int = 0
  checkpoint: str | None = None
  # Serving dtype of every region ("" = the config's / checkpoint's; "bfloat16":
  # weights, activations and KV in bf16, recurrent states f32).
  dtype: str = ""
  # Model name clients send ("" = the checkpoint's own name or the config name).
  served_model_name: str = ""
  n_slots: int = 8
  max_ctx: int = 0
  page_size: int = 16
  num_pages: int = 0
  max_queue: int = 64
  prefill_buckets: tuple[int, ...] = (64, 256)
  prefill_max_batch: int = 4
  batch_window_ms: float = 5.0
  threshold: float = 128.0
  # Scheduling (issue 7): "static" | "adaptive" broker router, and the hybrid
  # prefix cache block size of both regions' prefill (0: no prefix cache).
  router: str = "static"
  prefix_block: int = 0
  rebalance_every_s: float = 5.0
  link: LinkSpec | None = None
  netem: str = "relay"  # "relay" | "netns"
  # The relay's forwarding (netem): "splice" (in the kernel; Linux) or "asyncio".
  relay_engine: str = dataclasses.field(default_factory=default_engine)
  codec_compression: str = "raw"
  transfer_streams: int = 2
  # What carries state bytes A->B: "tcp" (the data plane, paas_jax.transport.
  # dataplane, through the WAN relay like the gRPC control) or "grpc" (Push
  # streams). With flaky_wan or prefill fault interceptors the bytes stay on
  # gRPC (those act on gRPC frames).
  transfer_plane: str = "tcp"
  transfer_lanes: int = 2
  compilation_cache: str | None = None
  log_level: str = "WARNING"
  startup_timeout_s: float = 600.0
  # Security (paas_jax.security): tls=True makes a local CA and a certificate
  # per role in workdir/certs (and one per process of a decode slice, its
  # peer rules a decode server's), mutual TLS between broker and regions, TLS
  # plus a bearer token (workdir/certs/client.token) on the broker's public
  # port. tls=False runs every process with an explicit --insecure.
  tls: bool = False
  # Fault injection in the prefill server (FaultPlan syntax, e.g.
  # "kill_after_layers=2"), and with flaky_wan a link (FlakyLinks,
  # paas_jax.security.faults) in front of PD node 0's StateTransfer port, or
  # each of its processes' ports when it is a slice (cluster.wan), that tests
  # and the demo can cut. Not with netem="netns".
  prefill_faults: str = ""
  # Extra prefill-server flags (e.g. "--commit_every=1", "--preempt_grace_s=0.5").
  prefill_args: tuple[str, ...] = ()
  # Tensor-parallel degree of the prefill and decode servers (--tp; needs that many
  # local devices: on CPU, XLA_FLAGS=--xla_force_host_platform_device_count).
  tp: int = 1
  flaky_wan: bool = False
  # Fault injection in every decode server and slice process (FaultPlan syntax,
  # e.g. "corrupt_states=2": damage received states behind the transport's checks).
  decode_faults: str = ""
  # Extra decode-server flags (e.g. "--decode_steps_per_sync=4").
  decode_args: tuple[str, ...] = ()
  # The fail-closed logit probe at the handoff (both regions; on by default).
  logit_probe: bool = True
  metrics: bool = False         # every process serves /metrics on a free port
  # PD nodes (decode servers) in region B: "decode", "decode1", ...; with more
  # than one the broker splits them into PD-P and PD-D roles (pd_prefill_nodes:
  # how many PD-P, -1: N // 2) and can move them (pd_roles.py).
  pd_nodes: int = 1
  pd_prefill_nodes: int = -1
  rebalance_apply: bool = False
  log_format: str = "text"      # "json": structured logs with request ids
  # The OpenAI-compatible HTTP gateway (paas_jax.frontdoor) beside the broker,
  # same TLS identity and tokens; its URL is LocalCluster.http_url.
  http: bool = False
  http_port: int = 0  # 0: any free port
  # Prefill as a shared service: one region-A pool serving N decode regions
  # (B, C, ...), each with its own PD nodes, link (region_links[i], default
  # ``link``), relay and broker (tenant "B", "C", ...). The pool shares its
  # batches between them by "wfq" (weights "B=2,C=1") or "fifo", with at most
  # ``tenant_quota`` prompts waiting per tenant (0: no per-tenant cap).
  decode_regions: int = 1
  region_links: tuple[LinkSpec | None, ...] = ()
  tenant_sharing: str = "wfq"
  tenant_weights: str = ""
  tenant_quota: int = 0
  # Region A as a prefill pod of this many processes (one JAX program, TP over
  # prefill_pod x prefill_pod_devices devices; serving/pod_prefill_server.py;
  # 1: the single-process prefill server). prefill_pod_fault: "<process>:
  # prefill|transfer", that pod process exits during its first request.
  prefill_pod: int = 1
  prefill_pod_devices: int = 1
  prefill_pod_fault: str = ""
  # Region B's decode server as a slice of this many processes (one JAX
  # program, TP over decode_slice x decode_slice_devices devices; serving/
  # slice_decode_server.py; 1: the single-process decode server). With
  # pd_nodes > 1 the first slice_nodes PD nodes are slices (role "both": each
  # prefills its own local requests) and the rest single decode servers
  # (pd_prefill_nodes splits those). Behind an emulated link the relay
  # forwards each slice process's StateTransfer port and data plane.
  decode_slice: int = 1
  decode_slice_devices: int = 1
  # How many PD nodes, from node 0 on, are slices of decode_slice processes
  # each ("decode", "decode1", ...; the rest single decode servers). Needs
  # decode_slice > 1 and slice_nodes <= pd_nodes (launch_args.check_decode_slice).
  slice_nodes: int = 1


class LocalCluster:
  """Region A, the decode regions (B, C, ...), their WAN relays and brokers as
  child processes. Region B's processes keep their plain names ("decode",
  "decode1", "relay", "broker"); region C's are "c.decode", "c.relay", ..."""

  def __init__(self, spec: ClusterSpec, workdir: str | os.PathLike | None = None):
    self.spec = spec
    self._tmp = None
    if workdir is None:
      self._tmp = tempfile.TemporaryDirectory(prefix="paas_cluster_")
      workdir = self._tmp.name
    self.workdir = pathlib.Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.procs: dict[str, Proc] = {}
    self.netns = None
    self.broker_addresses: dict[str, str] = {}
    self.relay_stats_file = self.workdir / "relay_stats.json"
    self.timings: dict[str, float] = {}
    self.certs: pathlib.Path | None = None
    self.wan = None  # FlakyLinks with spec.flaky_wan
    self.a_host = "127.0.0.1"  # where region A's prefill server serves
    # Per decode region: (the host region A dials for its transfer ports, the
    # host its processes bind and are reached on). One host here; each region's
    # node under Ray (ray_launch.py).
    self.region_hosts: dict[str, tuple[str, str]] = {}

  # -- placement hooks (ray_launch.RayCluster overrides these) --------------------

  def _place(self) -> tuple[str, str]:
    """Prepares the machines and sets ``region_hosts``; returns (region A's
    host, the host region A dials for region B's transfer ports)."""
    a_host, b_host = "127.0.0.1", "127.0.0.1"
    if self.spec.link is not None and self.spec.netem == "netns":
      if self.spec.decode_regions > 1:
        raise LaunchError("netem='netns' shapes one link: use the relay with decode_regions")
      self.netns = NetnsLink(self.spec.link).up()
      a_host, b_host = self.netns.a_ip, self.netns.b_ip
    self.region_hosts = {r: ("127.0.0.1", "127.0.0.1") for r in self.decode_regions}
    self.region_hosts["b"] = (b_host, "127.0.0.1")
    return a_host, b_host

  def _spawn(self, name: str, args: Sequence[str], region: str,
             prefix: Sequence[str] = ()) -> Proc:
    """Starts process ``name`` of ``region`` ("a", "b", "c", ...)."""
    del region  # one host
    return spawn(name, args, self.workdir, prefix=prefix)

  # -- lifecycle ------------------------------------------------------------------

  def start(self, on_tick=None) -> "LocalCluster":
    spec = self.spec
    t0 = time.monotonic()
    try:
      if spec.pd_nodes < 1:
        raise LaunchError(f"pd_nodes must be >= 1, got {spec.pd_nodes}")
      if not 1 <= spec.decode_regions <= 8:
        raise LaunchError(f"decode_regions must be in [1, 8], got {spec.decode_regions}")
      try:
        launch_args.check_decode_slice(spec)
      except ValueError as e:
        raise LaunchError(str(e)) from None
      a_host, b_host = self._place()
      self.a_host = a_host
      prefix = self.netns.exec_prefix() if self.netns is not None else []
      self._make_certs(a_host, b_host)
      self.procs["prefill"] = self._spawn(
          "prefill", launch_args.prefill_args(spec, a_host) + self._common_args("prefill"),
          "a", prefix=prefix)
      for region in self.decode_regions:
        # Behind a relay the data plane binds another loopback address; the relay
        # listens on the announced port at the host region A dials.
        relayed = self.link_of(region) is not None and spec.transfer_plane == "tcp"
        # With decode slices, PD nodes 0 .. slice_nodes - 1 are slices (each its
        # own supervisor, coordinator, ports and ready file) and the others
        # single decode servers (launch_args.pd_node_shapes).
        for node, name in enumerate(self.pd_names_of(region)):
          args = launch_args.decode_args(spec, self.local_host(region),
                                         _DATA_PLANE_HOST if relayed else None, node)
          self.procs[name] = self._spawn(name, args + self._common_args("decode"), region)
      wait_ready(list(self.procs.values()), spec.startup_timeout_s, on_tick)
      self.timings["regions_ready_s"] = time.monotonic() - t0
      for region in self.decode_regions:
        self._start_front(region, on_tick)
      if spec.http:
        self._start_gateway(on_tick)
      self.timings["cluster_ready_s"] = time.monotonic() - t0
      return self
    except BaseException:
      self.stop()
      raise

  def _start_front(self, region: str, on_tick=None) -> None:
    """A decode region's WAN relay (if its link is emulated) and broker."""
    spec = self.spec
    dial, local = self.region_hosts[region]
    link = self.link_of(region)
    pd_names = self.pd_names_of(region)
    prefill = self.procs["prefill"].info
    prefill_target = f"{self.a_host}:{prefill['port']}"
    # Region A's prefix-import port, where PD nodes ship cached prefixes (->A).
    prefix_target = f"{self.a_host}:{prefill['transfer_port']}"
    transfer_target = f"{local}:{self.procs[pd_names[0]].info['transfer_port']}"
    pd_info = [self.procs[n].info for n in pd_names]
    pd_local = [f"{local}:{d['transfer_port']}" for d in pd_info]
    # A decode slice's entry lists its processes: region A sends each its own parts.
    shapes = launch_args.pd_node_shapes(spec)
    if spec.flaky_wan and region == "b":
      if self.netns is not None:
        raise LaunchError("flaky_wan does not work with netem='netns'")
      # One link for node 0: in front of each of its processes when it is a slice.
      self.wan = FlakyLinks([transfer_target, *launch_routes.slice_others(
          shapes[0], pd_info[0])]).start()
      transfer_target = self.wan.address
      if len(self.wan.links) > 1:
        pd_info[0] = dict(pd_info[0], slice_transfer=self.wan.addresses)
    pd_wan = launch_routes.direct_entries(shapes, pd_info, transfer_target, pd_local)
    if link is not None:
      relay_link = (dataclasses.replace(link, shape_bandwidth=False)
                    if self.netns is not None else link)
      routes = launch_routes.relay_routes(
          shapes, pd_info, dial=dial, local=local, transfer_target=transfer_target,
          control_target=prefill_target, prefix_target=prefix_target,
          local_transfer=pd_local, tcp=spec.transfer_plane == "tcp",
          data_plane_host=_DATA_PLANE_HOST)
      relay = self._name(region, "relay")
      self.procs[relay] = self._spawn(
          relay, launch_args.relay_args(relay_link, self.relay_stats_path(region), routes,
                                       spec.relay_engine),
          region)
      wait_ready([self.procs[relay]], 60, on_tick)
      ports = self.procs[relay].info["ports"]
      pd_wan = launch_routes.relayed_entries(shapes, pd_info, ports, dial)
      prefill_target = f"{local}:{ports['control']}"
      prefix_target = f"{local}:{ports['prefix']}"
    broker = self._name(region, "broker")
    args = launch_args.broker_args(
        spec, host=local, link=link, prefill_target=prefill_target,
        prefix_target=prefix_target, pd_control=[f"{local}:{d['port']}" for d in pd_info],
        pd_wan=pd_wan, pd_local=pd_local,
        tenant=region.upper() if spec.decode_regions > 1 else "")
    self.procs[broker] = self._spawn(broker, args + self._common_args("broker"), region)
    wait_ready([self.procs[broker]], 120, on_tick)
    self.broker_addresses[region] = f"{local}:{self.procs[broker].info['port']}"

  def stop(self) -> None:
    names = (["gateway"] + [self._name(r, "broker") for r in self.decode_regions]
             + [self._name(r, "relay") for r in self.decode_regions] + ["prefill"]
             + [n for r in self.decode_regions for n in self.pd_names_of(r)])
    for name in names:
      proc = self.procs.get(name)
      if proc is not None:
        proc.stop()
    if self.wan is not None:
      self.wan.stop()
      self.wan = None
    if self.netns is not None:
      self.netns.down()
      self.netns = None

  def _start_gateway(self, on_tick=None) -> None:
    args = ["-m", "paas_jax.frontdoor", f"--broker={self.broker_address}",
            f"--port={self.spec.http_port}", f"--host={self.b_local}",
            f"--log_level={self.spec.log_level}", *self._common_args("broker")]
    if self.certs is not None:
      args.append(f"--api_token_file={self.certs / 'client.token'}")
    self.procs["gateway"] = self._spawn("gateway", args, "b")
    wait_ready([self.procs["gateway"]], 120, on_tick)

  @property
  def http_url(self) -> str:
    """Base URL of the OpenAI API (``.../v1``), with ``spec.http``."""
    scheme = "https" if self.certs is not None else "http"
    return f"{scheme}://{self.b_local}:{self.procs['gateway'].info['port']}/v1"

  # -- security and faults ------------------------------------------------------------

  def _make_certs(self, a_host: str, b_host: str) -> None:
    if not self.spec.tls:
      return
    self.certs = self.workdir / "certs"
    hosts = tuple(dict.fromkeys(ca_lib.DEFAULT_HOSTS + (a_host, b_host) + tuple(
        h for pair in self.region_hosts.values() for h in pair)))
    # Every decode slice's processes each get their own certificate (launch_args);
    # under Ray every file of certs/ travels with each actor (ray_launch).
    names = ("broker", "prefill", "decode", "client",
             *launch_args.all_slice_tls_names(self.spec))
    ca_lib.make_certs(self.certs, names, hosts=hosts, reuse_ca=False)
    (self.certs / "api_tokens.txt").unlink(missing_ok=True)
    write_token_files(self.certs, "client")

  def _common_args(self, role: str) -> list[str]:
    spec = self.spec
    args = [f"--log_format={spec.log_format}"]
    if spec.tls:
      args += [f"--tls_dir={self.certs}", f"--tls_name={role}"]
      if role == "broker":
        args.append(f"--api_tokens_file={self.certs / 'api_tokens.txt'}")
    else:
      args.append("--insecure")
    if spec.metrics:
      args.append("--metrics_port=0")
    return args

  @property
  def token(self) -> str | None:
    """The client's bearer token (tls=True)."""
    if self.certs is None:
      return None
    return (self.certs / "client.token").read_text().strip()

  def tls_config(self, name: str):
    """A ``TLSConfig`` with the identity ``name`` (broker, prefill, decode, client)."""
    if self.certs is None:
      return TLSConfig.plaintext(name)
    return TLSConfig.from_dir(self.certs, name)

  def client_credentials(self, token: str | None = "default"):
    """Channel credentials of a public client of the broker (None: plaintext)."""
    if self.certs is None:
      return None
    return channel_credentials(self.certs / "ca.pem",
                               token=self.token if token == "default" else token)

  def channel(self, name: str, as_role: str = "broker"):
    """A gRPC channel to process ``name``'s control port, authenticated as
    ``as_role`` (mutual TLS with that role's certificate; plaintext without tls)."""
    info = self.procs[name].info
    target = f"{self.host_of(name)}:{info['port']}"
    creds = self.tls_config(as_role).client() if self.certs is not None else None
    if creds is None:
      return grpc.insecure_channel(target)
    return grpc.secure_channel(target, creds)

  def kill(self, name: str) -> int:
    """SIGKILLs a process (a preempted machine); returns its exit status."""
    proc = self.procs[name]
    if proc.popen.poll() is None:
      proc.popen.kill()
    return proc.popen.wait(10)

  def restart(self, name: str, *, extra_args=(), drop_prefix: str | None = None,
              timeout_s: float | None = None) -> Proc:
    """Starts process ``name`` again on the same port(s), after it died or was
    stopped (a slice's supervisor: every process's transfer and data-plane
    ports too); ``drop_prefix`` removes arguments starting with it (e.g.
    "--faults")."""
    old = self.procs[name]
    old.stop()
    args = [a for a in old.args if not (drop_prefix and a.startswith(drop_prefix))]
    pinned = {"--port": old.info.get("port"), "--transfer_port": old.info.get("transfer_port")}
    if old.info.get("slice_transfer"):  # a slice: its other processes' ports too
      pinned["--slice_transfer_ports"] = ",".join(
          a.rsplit(":", 1)[1] for a in old.info["slice_transfer"][1:])
      pinned["--slice_data_plane_ports"] = ",".join(
          str(p) for p in old.info["slice_data_plane_ports"])
      args += [f for f in ("--slice_transfer_ports=", "--slice_data_plane_ports=")
               if not any(a.startswith(f) for a in args)]
    args = [f"{a.split('=', 1)[0]}={pinned[a.split('=', 1)[0]]}"
            if a.split("=", 1)[0] in pinned and pinned[a.split("=", 1)[0]] is not None else a
            for a in args] + list(extra_args)
    proc = self._spawn(name, args, self.region_of(name), prefix=old.prefix)
    self.procs[name] = proc
    wait_ready([proc], timeout_s or self.spec.startup_timeout_s)
    return proc

  def __enter__(self) -> "LocalCluster":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
    if self._tmp is not None:
      self._tmp.cleanup()

  # -- observation ----------------------------------------------------------------

  @property
  def decode_regions(self) -> list[str]:
    """The decode regions' letters: "b", then "c", ... (``spec.decode_regions``)."""
    return [chr(ord("b") + i) for i in range(max(self.spec.decode_regions, 1))]

  def link_of(self, region: str) -> LinkSpec | None:
    """Region ``region``'s emulated link to region A (``spec.region_links``)."""
    i = ord(region) - ord("b")
    links = self.spec.region_links
    return links[i] if i < len(links) else self.spec.link

  @staticmethod
  def _name(region: str, base: str) -> str:
    return base if region == "b" else f"{region}.{base}"

  @staticmethod
  def region_of(name: str) -> str:
    if name == "prefill":
      return "a"
    return name.split(".", 1)[0] if "." in name else "b"

  def pd_names_of(self, region: str) -> list[str]:
    return [self._name(region, n) for n in
            ["decode"] + [f"decode{i}" for i in range(1, max(self.spec.pd_nodes, 1))]]

  @property
  def pd_names(self) -> list[str]:
    """Region B's PD nodes: "decode" (the first, as before), "decode1", ..."""
    return self.pd_names_of("b")

  def local_host(self, region: str) -> str:
    return self.region_hosts.get(region, ("127.0.0.1", "127.0.0.1"))[1]

  @property
  def b_local(self) -> str:
    """Where region B's processes bind and are reached."""
    return self.local_host("b")

  @property
  def broker_address(self) -> str:
    """Region B's broker."""
    return self.broker_addresses.get("b", "")

  def host_of(self, name: str) -> str:
    """The address process ``name`` serves its control port on."""
    region = self.region_of(name)
    return self.a_host if region == "a" else self.local_host(region)

  def pd_address(self, name: str) -> str:
    return f"{self.host_of(name)}:{self.procs[name].info['port']}"

  @property
  def decode_address(self) -> str:
    return self.pd_address("decode")

  def relay_stats_path(self, region: str = "b") -> pathlib.Path:
    return (self.relay_stats_file if region == "b"
            else self.workdir / f"relay_stats.{region}.json")

  def relay_stats(self, region: str = "b") -> dict | None:
    try:
      return json.loads(self.relay_stats_path(region).read_text())
    except (OSError, ValueError):
      return None
