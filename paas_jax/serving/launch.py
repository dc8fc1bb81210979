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
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import grpc

from paas_jax.netem.link import LinkSpec
from paas_jax.netem.netns import NetnsLink
from paas_jax.security import TLSConfig, channel_credentials
from paas_jax.security import ca as ca_lib
from paas_jax.security.auth import write_token_files
from paas_jax.security.faults import FlakyLink

PY = sys.executable
# Loopback address PD nodes bind their data plane on when a WAN relay sits in front
# (the relay takes the announced port on the address region A dials).
_DATA_PLANE_HOST = "127.0.0.3"


class LaunchError(RuntimeError):
  pass


@dataclasses.dataclass
class Proc:
  """A child process that signals readiness by writing a JSON file."""

  name: str
  popen: subprocess.Popen
  ready_file: pathlib.Path
  log_file: pathlib.Path
  info: dict = dataclasses.field(default_factory=dict)
  args: tuple = ()
  prefix: tuple = ()

  def log_tail(self, lines: int = 30) -> str:
    try:
      return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
      return ""

  def poll_ready(self) -> bool:
    if self.info:
      return True
    if self.popen.poll() is not None:
      raise LaunchError(f"{self.name} exited with {self.popen.returncode} before it was "
                        f"ready; last log lines:\n{self.log_tail()}")
    if self.ready_file.exists():
      self.info = json.loads(self.ready_file.read_text())
      return True
    return False

  def stop(self, timeout_s: float = 10.0) -> None:
    if self.popen.poll() is None:
      self.popen.send_signal(signal.SIGTERM)
      try:
        self.popen.wait(timeout_s)
      except subprocess.TimeoutExpired:
        self.popen.kill()
        self.popen.wait(5)


def spawn(name: str, args: Sequence[str], workdir: pathlib.Path, *,
          prefix: Sequence[str] = (), env: dict | None = None) -> Proc:
  ready = workdir / f"{name}.ready.json"
  log = workdir / f"{name}.log"
  ready.unlink(missing_ok=True)
  full_env = dict(os.environ)
  full_env.update(env or {})
  full_env.setdefault("PYTHONUNBUFFERED", "1")
  with open(log, "a") as f:
    popen = subprocess.Popen([*prefix, PY, *args, f"--ready_file={ready}"], stdout=f,
                             stderr=subprocess.STDOUT, env=full_env,
                             cwd=str(pathlib.Path(__file__).resolve().parents[2]))
  return Proc(name, popen, ready, log, args=tuple(args), prefix=tuple(prefix))


def wait_ready(procs: Sequence[Proc], timeout_s: float, on_tick=None) -> None:
  deadline = time.monotonic() + timeout_s
  while True:
    if all(p.poll_ready() for p in procs):
      return
    if time.monotonic() > deadline:
      late = [p.name for p in procs if not p.info]
      raise LaunchError(f"{late} not ready after {timeout_s:.0f} s")
    if on_tick is not None:
      on_tick()
    time.sleep(0.1)


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
  # per process in workdir/certs, mutual TLS between broker and regions, TLS
  # plus a bearer token (workdir/certs/client.token) on the broker's public
  # port. tls=False runs every process with an explicit --insecure.
  tls: bool = False
  # Fault injection in the prefill server (FaultPlan syntax, e.g.
  # "kill_after_layers=2"), and a FlakyLink (paas_jax.security.faults) in
  # front of the decode server's StateTransfer port (cluster.wan) that tests
  # and the demo can cut. Not with netem="netns".
  prefill_faults: str = ""
  # Extra prefill-server flags (e.g. "--commit_every=1", "--preempt_grace_s=0.5").
  prefill_args: tuple[str, ...] = ()
  flaky_wan: bool = False
  # Fault injection in every decode server (FaultPlan syntax, e.g.
  # "corrupt_states=2": damage received states behind the transport's checks).
  decode_faults: str = ""
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


def _link_bps(link: LinkSpec | None) -> float:
  """The link capacity the broker's router assumes (no emulation: 10 Gbps)."""
  if link is None or not 0 < link.bandwidth_bps < float("inf"):
    return 10e9
  return float(link.bandwidth_bps)


def _server_args(spec: ClusterSpec, host: str) -> list[str]:
  args = [f"--config={spec.config}", f"--seed={spec.seed}", f"--host={host}", "--port=0",
          f"--max_ctx={spec.max_ctx}", f"--prefill_max_batch={spec.prefill_max_batch}",
          f"--prefill_buckets={','.join(str(b) for b in spec.prefill_buckets)}",
          f"--batch_window_ms={spec.batch_window_ms}", f"--log_level={spec.log_level}",
          f"--prefix_block={spec.prefix_block}", f"--logit_probe={spec.logit_probe}"]
  if spec.checkpoint:
    args.append(f"--checkpoint={spec.checkpoint}")
  if spec.dtype:
    args.append(f"--dtype={spec.dtype}")
  if spec.compilation_cache is not None:
    args.append(f"--compilation_cache={spec.compilation_cache}")
  return args


class LocalCluster:
  """Region A, region B, the WAN relay and the broker as child processes."""

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
    self.broker_address = ""
    self.relay_stats_file = self.workdir / "relay_stats.json"
    self.timings: dict[str, float] = {}
    self.certs: pathlib.Path | None = None
    self.wan = None  # a FlakyLink with spec.flaky_wan

  # -- lifecycle ------------------------------------------------------------------

  def start(self, on_tick=None) -> "LocalCluster":
    spec = self.spec
    t0 = time.monotonic()
    try:
      a_host = b_host = "127.0.0.1"
      prefix: list[str] = []
      if spec.link is not None and spec.netem == "netns":
        self.netns = NetnsLink(spec.link).up()
        prefix = self.netns.exec_prefix()
        a_host, b_host = self.netns.a_ip, self.netns.b_ip
      self._make_certs(a_host, b_host)
      prefill_args = ["-m", "paas_jax.serving.prefill_server", *_server_args(spec, a_host),
                      f"--codec_compression={spec.codec_compression}",
                      f"--transfer_streams={spec.transfer_streams}",
                      f"--transfer_plane={'grpc' if spec.flaky_wan else spec.transfer_plane}",
                      f"--transfer_lanes={spec.transfer_lanes}",
                      # Imports PD-P's prefixes (cross-cluster prefix cache); explicit
                      # so that restart() keeps the port the relay forwards to.
                      "--transfer_port=0",
                      *self._common_args("prefill")]
      if spec.prefill_faults:
        prefill_args.append(f"--faults={spec.prefill_faults}")
      prefill_args += list(spec.prefill_args)
      decode_args = ["-m", "paas_jax.serving.decode_server",
                     *_server_args(spec, "127.0.0.1"), "--transfer_port=0",
                     f"--n_slots={spec.n_slots}", f"--page_size={spec.page_size}",
                     f"--num_pages={spec.num_pages}", f"--max_queue={spec.max_queue}",
                     f"--transfer_plane={spec.transfer_plane}",
                     *self._common_args("decode")]
      if spec.decode_faults:
        decode_args.append(f"--faults={spec.decode_faults}")
      if spec.link is not None and spec.transfer_plane == "tcp":
        # The relay listens on the announced data-plane port at the host
        # region A dials (b_host) and forwards to this other loopback address.
        decode_args.append(f"--data_plane_host={_DATA_PLANE_HOST}")
      if spec.pd_nodes < 1:
        raise LaunchError(f"pd_nodes must be >= 1, got {spec.pd_nodes}")
      self.procs["prefill"] = spawn("prefill", prefill_args, self.workdir, prefix=prefix)
      for name in self.pd_names:
        self.procs[name] = spawn(name, decode_args, self.workdir)
      wait_ready([self.procs["prefill"]] + [self.procs[n] for n in self.pd_names],
                 spec.startup_timeout_s, on_tick)
      self.timings["regions_ready_s"] = time.monotonic() - t0
      prefill_port = self.procs["prefill"].info["port"]
      decode = self.procs["decode"].info
      prefill_target = f"{a_host}:{prefill_port}"
      # Region A's prefix-import port, where PD nodes ship cached prefixes (B->A).
      prefix_target = f"{a_host}:{self.procs['prefill'].info['transfer_port']}"
      transfer_target = f"127.0.0.1:{decode['transfer_port']}"
      if spec.flaky_wan:
        if self.netns is not None:
          raise LaunchError("flaky_wan does not work with netem='netns'")
        self.wan = FlakyLink(transfer_target).start()
        transfer_target = self.wan.address
      if spec.link is not None:
        link = spec.link
        if self.netns is not None:
          link = dataclasses.replace(link, shape_bandwidth=False)
        bw = link.bandwidth_bps if link.bandwidth_bps < float("inf") else 0
        relay_args = ["-m", "paas_jax.netem", f"--bandwidth={bw}",
                      f"--rtt_ms={link.rtt_s * 1e3}", f"--jitter_ms={link.jitter_s * 1e3}",
                      f"--shape_bandwidth={link.shape_bandwidth}", f"--seed={link.seed}",
                      f"--stats_file={self.relay_stats_file}",
                      f"--route=transfer={b_host}:0->{transfer_target}@a_to_b",
                      f"--route=control=127.0.0.1:0->{prefill_target}@b_to_a",
                      f"--route=prefix=127.0.0.1:0->{prefix_target}@b_to_a"]
        # Data planes of the PD nodes, over the same link, on the port they announce.
        for i, name in enumerate(self.pd_names):
          dp = self.procs[name].info.get("data_plane_port", 0)
          if dp and spec.transfer_plane == "tcp":
            relay_args.append(f"--route=dataplane{i}={b_host}:{dp}->{_DATA_PLANE_HOST}:{dp}"
                              "@a_to_b")
        # The other PD nodes' StateTransfer ports, over the same link (PrfaaS states).
        for i, name in enumerate(self.pd_names[1:], 1):
          relay_args.append(f"--route=transfer{i}={b_host}:0->127.0.0.1:"
                            f"{self.procs[name].info['transfer_port']}@a_to_b")
        if link.trace is not None:
          trace = ",".join(f"{t}:{r}" for t, r in link.trace.points)
          if link.trace.loop:
            trace += f",period={link.trace.period}"
          relay_args.append(f"--trace={trace}")
        self.procs["relay"] = spawn("relay", relay_args, self.workdir)
        wait_ready([self.procs["relay"]], 60, on_tick)
        ports = self.procs["relay"].info["ports"]
        transfer_target = f"{b_host}:{ports['transfer']}"
        prefill_target = f"127.0.0.1:{ports['control']}"
        prefix_target = f"127.0.0.1:{ports['prefix']}"
      # PD node i: control, transfer as region A reaches it (WAN), transfer
      # inside region B (PD-P -> PD-D, direct).
      pd_info = [self.procs[n].info for n in self.pd_names]
      pd_control = [f"127.0.0.1:{d['port']}" for d in pd_info]
      pd_local = [f"127.0.0.1:{d['transfer_port']}" for d in pd_info]
      pd_wan = [transfer_target] + (
          [f"{b_host}:{self.procs['relay'].info['ports'][f'transfer{i}']}"
           for i in range(1, len(pd_info))] if spec.link is not None else pd_local[1:])
      broker_config = "" if spec.checkpoint else spec.config
      broker_args = ["-m", "paas_jax.serving.broker", f"--config={broker_config}", "--port=0",
                     f"--prefill={prefill_target}", f"--prefill_transfer={prefix_target}",
                     f"--decode={','.join(pd_control)}",
                     f"--decode_transfer={','.join(pd_wan)}",
                     f"--decode_local_transfer={','.join(pd_local)}",
                     f"--pd_prefill_nodes={spec.pd_prefill_nodes}",
                     f"--rebalance_apply={spec.rebalance_apply}",
                     f"--threshold={spec.threshold}", f"--log_level={spec.log_level}",
                     f"--router={spec.router}", f"--n_slots={spec.n_slots}",
                     f"--rebalance_every_s={spec.rebalance_every_s}",
                     f"--link_bandwidth_bps={_link_bps(spec.link)}",
                     *self._common_args("broker")]
      if spec.checkpoint:  # its tokenizer, chat template, EOS ids and name
        broker_args.append(f"--checkpoint={spec.checkpoint}")
      if spec.served_model_name:
        broker_args.append(f"--served_model_name={spec.served_model_name}")
      self.procs["broker"] = spawn("broker", broker_args, self.workdir)
      wait_ready([self.procs["broker"]], 120, on_tick)
      self.broker_address = f"127.0.0.1:{self.procs['broker'].info['port']}"
      if spec.http:
        self._start_gateway(on_tick)
      self.timings["cluster_ready_s"] = time.monotonic() - t0
      return self
    except BaseException:
      self.stop()
      raise

  def stop(self) -> None:
    for name in ("gateway", "broker", "relay", "prefill", *self.pd_names):
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
            f"--port={self.spec.http_port}",
            f"--log_level={self.spec.log_level}", *self._common_args("broker")]
    if self.certs is not None:
      args.append(f"--api_token_file={self.certs / 'client.token'}")
    self.procs["gateway"] = spawn("gateway", args, self.workdir)
    wait_ready([self.procs["gateway"]], 120, on_tick)

  @property
  def http_url(self) -> str:
    """Base URL of the OpenAI API (``.../v1``), with ``spec.http``."""
    scheme = "https" if self.certs is not None else "http"
    return f"{scheme}://127.0.0.1:{self.procs['gateway'].info['port']}/v1"

  # -- security and faults ------------------------------------------------------------

  def _make_certs(self, a_host: str, b_host: str) -> None:
    if not self.spec.tls:
      return
    self.certs = self.workdir / "certs"
    hosts = tuple(dict.fromkeys(ca_lib.DEFAULT_HOSTS + (a_host, b_host)))
    ca_lib.make_certs(self.certs, ("broker", "prefill", "decode", "client"), hosts=hosts,
                      reuse_ca=False)
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
    host = self.netns.a_ip if (name == "prefill" and self.netns is not None) else "127.0.0.1"
    target = f"{host}:{info['port']}"
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
    stopped; ``drop_prefix`` removes arguments starting with it (e.g. "--faults")."""
    old = self.procs[name]
    old.stop()
    args = [a for a in old.args if not (drop_prefix and a.startswith(drop_prefix))]
    pinned = {"--port": old.info.get("port"), "--transfer_port": old.info.get("transfer_port")}
    args = [f"{a.split('=', 1)[0]}={pinned[a.split('=', 1)[0]]}"
            if a.split("=", 1)[0] in pinned and pinned[a.split("=", 1)[0]] is not None else a
            for a in args] + list(extra_args)
    proc = spawn(name, args, self.workdir, prefix=old.prefix)
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
  def pd_names(self) -> list[str]:
    """The PD nodes' process names: "decode" (the first, as before), "decode1", ..."""
    return ["decode"] + [f"decode{i}" for i in range(1, max(self.spec.pd_nodes, 1))]

  def pd_address(self, name: str) -> str:
    return f"127.0.0.1:{self.procs[name].info['port']}"

  @property
  def decode_address(self) -> str:
    return f"127.0.0.1:{self.procs['decode'].info['port']}"

  def relay_stats(self) -> dict | None:
    try:
      return json.loads(self.relay_stats_file.read_text())
    except (OSError, ValueError):
      return None
