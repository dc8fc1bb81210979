"""Starts a two-region deployment as separate OS processes (demo and tests).

  region A  : prefill server (PrfaaS)       python -m paas_jax.serving.prefill_server
  region B  : decode server (PD-D + PD-P)   python -m paas_jax.serving.decode_server
  WAN link  : relay between A and B         python -m paas_jax.netem
  front door: broker                        python -m paas_jax.serving.broker

The link carries the state transfers (A -> B) and the broker's control calls
to region A (B -> A). With ``netem="netns"`` region A runs in its own network
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

from paas_jax.netem.link import LinkSpec

PY = sys.executable


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
  with open(log, "w") as f:
    popen = subprocess.Popen([*prefix, PY, *args, f"--ready_file={ready}"], stdout=f,
                             stderr=subprocess.STDOUT, env=full_env,
                             cwd=str(pathlib.Path(__file__).resolve().parents[2]))
  return Proc(name, popen, ready, log)


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
  n_slots: int = 8
  max_ctx: int = 0
  page_size: int = 16
  num_pages: int = 0
  max_queue: int = 64
  prefill_buckets: tuple[int, ...] = (64, 256)
  prefill_max_batch: int = 4
  batch_window_ms: float = 5.0
  threshold: float = 128.0
  link: LinkSpec | None = None
  netem: str = "relay"  # "relay" | "netns"
  codec_compression: str = "raw"
  transfer_streams: int = 2
  compilation_cache: str | None = None
  log_level: str = "WARNING"
  startup_timeout_s: float = 600.0


def _server_args(spec: ClusterSpec, host: str) -> list[str]:
  args = [f"--config={spec.config}", f"--seed={spec.seed}", f"--host={host}", "--port=0",
          f"--max_ctx={spec.max_ctx}", f"--prefill_max_batch={spec.prefill_max_batch}",
          f"--prefill_buckets={','.join(str(b) for b in spec.prefill_buckets)}",
          f"--batch_window_ms={spec.batch_window_ms}", f"--log_level={spec.log_level}"]
  if spec.checkpoint:
    args.append(f"--checkpoint={spec.checkpoint}")
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

  # -- lifecycle ------------------------------------------------------------------

  def start(self, on_tick=None) -> "LocalCluster":
    spec = self.spec
    t0 = time.monotonic()
    try:
      a_host = b_host = "127.0.0.1"
      prefix: list[str] = []
      if spec.link is not None and spec.netem == "netns":
        from paas_jax.netem.netns import NetnsLink  # pylint: disable=g-import-not-at-top
        self.netns = NetnsLink(spec.link).up()
        prefix = self.netns.exec_prefix()
        a_host, b_host = self.netns.a_ip, self.netns.b_ip
      prefill_args = ["-m", "paas_jax.serving.prefill_server", *_server_args(spec, a_host),
                      f"--codec_compression={spec.codec_compression}",
                      f"--transfer_streams={spec.transfer_streams}"]
      decode_args = ["-m", "paas_jax.serving.decode_server",
                     *_server_args(spec, "127.0.0.1"), "--transfer_port=0",
                     f"--n_slots={spec.n_slots}", f"--page_size={spec.page_size}",
                     f"--num_pages={spec.num_pages}", f"--max_queue={spec.max_queue}"]
      self.procs["prefill"] = spawn("prefill", prefill_args, self.workdir, prefix=prefix)
      self.procs["decode"] = spawn("decode", decode_args, self.workdir)
      wait_ready([self.procs["prefill"], self.procs["decode"]], spec.startup_timeout_s,
                 on_tick)
      self.timings["regions_ready_s"] = time.monotonic() - t0
      prefill_port = self.procs["prefill"].info["port"]
      decode = self.procs["decode"].info
      prefill_target = f"{a_host}:{prefill_port}"
      transfer_target = f"127.0.0.1:{decode['transfer_port']}"
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
                      f"--route=control=127.0.0.1:0->{prefill_target}@b_to_a"]
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
      broker_config = "" if spec.checkpoint else spec.config
      broker_args = ["-m", "paas_jax.serving.broker", f"--config={broker_config}", "--port=0",
                     f"--prefill={prefill_target}", f"--decode=127.0.0.1:{decode['port']}",
                     f"--decode_transfer={transfer_target}",
                     f"--threshold={spec.threshold}", f"--log_level={spec.log_level}"]
      self.procs["broker"] = spawn("broker", broker_args, self.workdir)
      wait_ready([self.procs["broker"]], 120, on_tick)
      self.broker_address = f"127.0.0.1:{self.procs['broker'].info['port']}"
      self.timings["cluster_ready_s"] = time.monotonic() - t0
      return self
    except BaseException:
      self.stop()
      raise

  def stop(self) -> None:
    for name in ("broker", "relay", "prefill", "decode"):
      proc = self.procs.get(name)
      if proc is not None:
        proc.stop()
    if self.netns is not None:
      self.netns.down()
      self.netns = None

  def __enter__(self) -> "LocalCluster":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
    if self._tmp is not None:
      self._tmp.cleanup()

  # -- observation ----------------------------------------------------------------

  @property
  def decode_address(self) -> str:
    return f"127.0.0.1:{self.procs['decode'].info['port']}"

  def relay_stats(self) -> dict | None:
    try:
      return json.loads(self.relay_stats_file.read_text())
    except (OSError, ValueError):
      return None
