"""Socket settings for long fat links: buffers from the bandwidth-delay product,
an optional congestion-control choice, and loss read back from TCP_INFO."""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct

log = logging.getLogger(__name__)

# Linux struct tcp_info: tcpi_retransmits is byte 2, tcpi_total_retrans the
# u32 at offset 100 (stable since 2.6), tcpi_rtt (us) at 68, tcpi_snd_cwnd at 80.
_TCP_INFO_LEN = 104
_MIN_BUFFER = 256 << 10
_MAX_BUFFER = 256 << 20


@dataclasses.dataclass(frozen=True)
class Tuning:
  """How data-plane connections are set up.

  Attributes:
    rate_bytes_per_s, rtt_s: the link the buffers are sized for; the socket
      buffers get 2x the bandwidth-delay product (clamped to [256 KiB,
      256 MiB]) so that one connection can fill the pipe while acks are in
      flight. Defaults suit a 10 Gbit/s, 1 ms path.
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
  """Buffers, TCP_NODELAY (frames are large; replies must not wait) and congestion."""
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  size = tuning.buffer_bytes
  for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
    try:
      sock.setsockopt(socket.SOL_SOCKET, opt, size)
    except OSError as e:  # capped by net.core.[rw]mem_max; the kernel still autotunes
      log.debug("setsockopt(%s, %d): %s", opt, size, e)
  if tuning.congestion:
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, tuning.congestion.encode())
    except (OSError, AttributeError) as e:
      log.warning("TCP_CONGESTION=%s not available (%s); using the system default",
                  tuning.congestion, e)


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
