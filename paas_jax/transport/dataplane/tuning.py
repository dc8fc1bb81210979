"""Socket settings for long fat links: buffers from the bandwidth-delay product,
an optional congestion-control choice, and loss read back from TCP_INFO."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import socket
import struct

log = logging.getLogger(__name__)

# Linux struct tcp_info: tcpi_retransmits is byte 2, tcpi_total_retrans the
# u32 at offset 100 (stable since 2.6), tcpi_rtt (us) at 68, tcpi_snd_cwnd at 80.
_TCP_INFO_LEN = 104
_MIN_BUFFER = 256 << 10
_MAX_BUFFER = 256 << 20
# ``lanes_for``: windows per bandwidth-delay product. Measured on the emulated
# WAN (bench_transfer --wan, 30 ms, 4 MiB per connection, 1.61 GB states): at 4
# and 6 Gbit/s, ceil(1.5 x BDP / window) connections (6 and 9) reached 97% and
# 95% of the link, as 8 did. At 10 Gbit/s, near the 2-core emulator's own
# ceiling, 14, 16 and 18 connections gave 82%, 89-92% and 78-86% from run to
# run. BDP / window connections are too few (10 Gbit/s at 50 ms, 16 x 4 MiB for
# 62.5 MB: 83%): loss and slow start keep a connection below its window.
_WINDOWS_PER_BDP = 1.5
AUTO_LANES_MAX = 32


@dataclasses.dataclass(frozen=True)
class Tuning:
  """How data-plane connections are set up.

  Attributes:
    rate_bytes_per_s, rtt_s: the link the buffers are sized for: each
      socket buffer must reach 2x the bandwidth-delay product (clamped to
      [256 KiB, 256 MiB]) so that one connection can fill the pipe while
      acks are in flight (``buffer_plan`` says how). Defaults suit a
      10 Gbit/s, 1 ms path.
    congestion: TCP_CONGESTION to ask for (e.g. "bbr"); None keeps the
      system default. A name the kernel lacks is logged and ignored.
    connect_timeout_s: TCP connect plus TLS handshake.
    io_timeout_s: granularity of blocking socket calls, i.e. how quickly a
      blocked sender notices an abort or a deadline.
    stall_timeout_s: a connection with frames outstanding and no reply for
      this long is declared dead (its frames go to the other connections).
    retain_freed_memory: a receiver asks glibc to keep freed receive buffers
      for reuse (``buffers.retain_freed_memory``, process-wide) rather than
      page-fault fresh memory for every transfer.
  """

  rate_bytes_per_s: float = 1.25e9
  rtt_s: float = 0.001
  congestion: str | None = None
  connect_timeout_s: float = 5.0
  io_timeout_s: float = 0.2
  stall_timeout_s: float = 30.0
  retain_freed_memory: bool = True

  @property
  def buffer_bytes(self) -> int:
    bdp = self.rate_bytes_per_s * self.rtt_s
    return int(min(max(2 * bdp, _MIN_BUFFER), _MAX_BUFFER))


def apply(sock: socket.socket, tuning: Tuning) -> None:
  """Buffers (``buffer_plan``), TCP_NODELAY (frames are large; replies must
  not wait) and congestion."""
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  size = tuning.buffer_bytes
  for opt, limits in ((socket.SO_SNDBUF, kernel_limits("w")),
                      (socket.SO_RCVBUF, kernel_limits("r"))):
    value = buffer_plan(size, *limits)
    if value is None:
      continue
    try:
      sock.setsockopt(socket.SOL_SOCKET, opt, value)
    except OSError as e:
      log.debug("setsockopt(%s, %d): %s", opt, value, e)
  if tuning.congestion:
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, tuning.congestion.encode())
    except (OSError, AttributeError) as e:
      log.warning("TCP_CONGESTION=%s not available (%s); using the system default",
                  tuning.congestion, e)


def lanes_for(tuning: Tuning, window_bytes: int, send_reach: int | None = None,
              max_lanes: int = AUTO_LANES_MAX) -> int:
  """How many connections keep ``tuning``'s link full: 1.5x its
  bandwidth-delay product over what one connection can have in flight (the
  smaller of ``window_bytes``, the data plane's unacknowledged bytes per
  connection, and ``send_reach``, what its send buffer may hold:
  ``send_buffer_reach``), within [1, ``max_lanes``].

  E.g. 4 Gbit/s at 30 ms with 4 MiB per connection: 6; the default
  ``Tuning`` (10 Gbit/s, 1 ms) with 16 MiB: 1.
  """
  per_lane = window_bytes if send_reach is None else min(window_bytes, send_reach)
  if per_lane < 1 or max_lanes < 1:
    raise ValueError(f"lanes_for: window {per_lane} and max_lanes {max_lanes} must be >= 1")
  bdp = tuning.rate_bytes_per_s * tuning.rtt_s
  return max(1, min(max_lanes, math.ceil(_WINDOWS_PER_BDP * bdp / per_lane)))


def send_buffer_reach(tuning: Tuning) -> int | None:
  """Bytes a connection's send buffer may reach once ``apply`` set it up on
  this host (``buffer_plan`` with the kernel's limits: autotuning's ceiling,
  or twice the value set); None where the limits are unknown."""
  autotune_max, setsockopt_max = kernel_limits("w")
  if autotune_max is None or setsockopt_max is None:
    return None
  value = buffer_plan(tuning.buffer_bytes, autotune_max, setsockopt_max)
  return autotune_max if value is None else 2 * min(value, setsockopt_max)


def buffer_plan(size: int, autotune_max: int | None, setsockopt_max: int | None) -> int | None:
  """What to pass to ``setsockopt(SO_SNDBUF / SO_RCVBUF)`` for a buffer of
  ``size`` bytes, or None to leave the kernel's autotuning on.

  Linux grows an unset buffer as the flow needs, up to ``tcp_[rw]mem[2]``
  (``autotune_max``). Setting one locks it at twice the value asked, and
  caps the value at ``net.core.[rw]mem_max`` (``setsockopt_max``) without
  an error. A locked buffer below what autotuning reaches costs throughput:
  100 MB states over loopback ran 3-5% slower into receive buffers locked at
  5 MB (the default ``Tuning``) than into autotuned ones (four interleaved
  A/B runs, 1 and 4 connections), and on a long fat link a buffer capped at
  2x ``rmem_max`` (8 MiB on a stock kernel) is far below the
  bandwidth-delay product. So: autotuning when it reaches the size; else the explicit value
  when it gets more than autotuning would; else autotuning, logged, since
  neither reaches the size (raise the sysctls). Off Linux (limits unknown,
  None): the explicit value.
  """
  if autotune_max is None or setsockopt_max is None:
    return size
  if autotune_max >= 2 * size:
    return None
  if 2 * min(size, setsockopt_max) > autotune_max:
    return size
  _log_short_buffers(2 * size, autotune_max, 2 * setsockopt_max)
  return None


@functools.lru_cache(maxsize=64)
def _log_short_buffers(wanted: int, autotune_max: int, set_max: int) -> None:
  # Cached: once per distinct limit, not once per connection.
  log.info("socket buffer of %d bytes wanted; the kernel allows %d (tcp_[rw]mem[2]) or "
           "%d (2x net.core.[rw]mem_max): raise them to fill this link", wanted,
           autotune_max, set_max)


def kernel_limits(direction: str) -> tuple[int | None, int | None]:
  """(autotuning ceiling ``net.ipv4.tcp_{direction}mem[2]``, setsockopt cap
  ``net.core.{direction}mem_max``) for ``direction`` "r" or "w"; None
  where /proc/sys does not say."""
  try:
    with open(f"/proc/sys/net/ipv4/tcp_{direction}mem") as f:
      autotune_max = int(f.read().split()[2])
    with open(f"/proc/sys/net/core/{direction}mem_max") as f:
      setsockopt_max = int(f.read())
  except (OSError, ValueError, IndexError):
    return None, None
  return autotune_max, setsockopt_max


def congestion_of(sock: socket.socket) -> str | None:
  try:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
  except (OSError, AttributeError):
    return None


@dataclasses.dataclass(frozen=True)
class TcpInfo:
  """What the kernel says about one connection (Linux TCP_INFO)."""

  total_retrans: int
  rtt_us: int
  snd_cwnd: int


def tcp_info(sock: socket.socket) -> TcpInfo | None:
  """TCP_INFO of a connected socket; None where the platform has none."""
  try:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
  except (OSError, AttributeError):
    return None
  if len(raw) < _TCP_INFO_LEN:
    return None
  rtt, = struct.unpack_from("<I", raw, 68)
  cwnd, = struct.unpack_from("<I", raw, 80)
  total, = struct.unpack_from("<I", raw, 100)
  return TcpInfo(total_retrans=total, rtt_us=rtt, snd_cwnd=cwnd)
