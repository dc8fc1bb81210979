"""Kernel-shaped link: region A in its own network namespace, tbf both ways.

Where root and iproute2 allow, region A runs inside a network namespace
joined to the root namespace (region B) by a veth pair; each end has a tbf
qdisc at the link's bandwidth, changed over time when the spec has a trace.
netem is often unavailable, so RTT and jitter still come from the userspace
relay (run with ``shape_bandwidth=False``).

Only namespaces and links created here are touched, and ``down`` removes them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import threading
import time
import uuid

from paas_jax.netem.link import LinkSpec


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=10)


def available() -> tuple[bool, str]:
  """Whether namespaces with tbf can be created here, and why not."""
  if os.geteuid() != 0:
    return False, "needs root"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return False, f"{tool} (iproute2) not found"
  name = f"paasprobe{uuid.uuid4().hex[:6]}"
  try:
    _run("ip", "netns", "add", name)
  except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
    return False, f"cannot create a network namespace: {getattr(e, 'stderr', e)}"
  _run("ip", "netns", "del", name, check=False)
  return True, "ok"


def _tbf_args(rate_bps: float) -> list[str]:
  # tbf cannot express 0: an outage becomes 8 kbit/s.
  rate = max(rate_bps, 8e3)
  # The bucket must hold at least one MTU and one timer tick of traffic.
  burst = max(16 << 10, int(rate / 8 / 250))
  return ["rate", f"{int(rate)}bit", "burst", str(burst), "latency", "500ms"]


@dataclasses.dataclass
class NetnsLink:
  """Creates namespace ``ns`` (region A) and veth ``host_dev`` <-> ``ns_dev``.

  Region B (root namespace) is ``b_ip``; region A is ``a_ip``.
  """

  spec: LinkSpec
  index: int = 0
  tag: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:6])

  def __post_init__(self):
    self.ns = f"paas_a_{self.tag}"
    self.host_dev = f"pb{self.tag}"
    self.ns_dev = f"pa{self.tag}"
    octet = 16 + (self.index % 200)
    self.b_ip = f"10.213.{octet}.1"
    self.a_ip = f"10.213.{octet}.2"
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.is_up = False

  def exec_prefix(self) -> list[str]:
    """Command prefix that runs a process inside region A."""
    return ["ip", "netns", "exec", self.ns]

  def up(self) -> "NetnsLink":
    try:
      _run("ip", "netns", "add", self.ns)
      self.is_up = True
      _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
      _run("ip", "link", "set", self.ns_dev, "netns", self.ns)
      _run("ip", "addr", "add", f"{self.b_ip}/30", "dev", self.host_dev)
      _run("ip", "link", "set", self.host_dev, "up")
      _run(*self.exec_prefix(), "ip", "addr", "add", f"{self.a_ip}/30", "dev", self.ns_dev)
      _run(*self.exec_prefix(), "ip", "link", "set", self.ns_dev, "up")
      _run(*self.exec_prefix(), "ip", "link", "set", "lo", "up")
      self._set_rate(self._rate_at(0.0), "add")
    except subprocess.CalledProcessError as e:
      self.down()
      raise RuntimeError(f"network namespace setup failed: {' '.join(e.cmd)}: {e.stderr}")
    trace = self.spec.trace
    if trace is not None and len(trace.points) > 1:
      self._thread = threading.Thread(target=self._follow_trace, daemon=True,
                                      name="netns-trace")
      self._thread.start()
    return self

  def _rate_at(self, t: float) -> float:
    trace = self.spec.effective_trace
    if trace is None:
      return 100e9
    return trace.rate_at(t)

  def _set_rate(self, rate: float, verb: str = "change") -> None:
    args = _tbf_args(rate)
    _run("tc", "qdisc", verb, "dev", self.host_dev, "root", "tbf", *args)
    _run(*self.exec_prefix(), "tc", "qdisc", verb, "dev", self.ns_dev, "root", "tbf", *args)

  def _follow_trace(self) -> None:
    t0 = time.monotonic()
    trace = self.spec.trace
    current = self._rate_at(0.0)
    while not self._stop.wait(0.05):
      rate = trace.rate_at(time.monotonic() - t0)
      if rate != current and math.isfinite(rate):
        try:
          self._set_rate(rate)
          current = rate
        except subprocess.CalledProcessError:
          pass

  def down(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=2)
    if self.is_up:
      _run("ip", "netns", "del", self.ns, check=False)
      _run("ip", "link", "del", self.host_dev, check=False)
      self.is_up = False

  def __enter__(self) -> "NetnsLink":
    return self.up()

  def __exit__(self, *exc) -> None:
    self.down()
