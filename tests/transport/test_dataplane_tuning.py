"""Socket buffers of the data plane: the kernel's autotuning is kept unless an
explicit size gets more (``tuning.buffer_plan``), checked on the arithmetic
and on real sockets."""

import logging
import socket
import sys

import pytest

from paas_jax.transport.dataplane import tuning as tuning_lib
from paas_jax.transport.dataplane.tuning import Tuning, buffer_plan, kernel_limits

MiB = 1 << 20
# A stock Linux kernel: tcp_rmem[2] 32 MiB, tcp_wmem[2] 4 MiB, [rw]mem_max 4 MiB.
STOCK_RMEM, STOCK_WMEM, STOCK_MAX = 32 * MiB, 4 * MiB, 4 * MiB


def test_autotuning_kept_where_it_reaches_the_size():
  # The default Tuning (10 Gbit/s, 1 ms: 2.5 MB) on the receive side.
  assert buffer_plan(Tuning().buffer_bytes, STOCK_RMEM, STOCK_MAX) is None
  assert buffer_plan(16 * MiB, STOCK_RMEM, STOCK_MAX) is None  # exactly reached


def test_explicit_size_where_it_gets_more_than_autotuning():
  # Send side of a stock kernel: autotuning stops at 4 MiB, a set 2.5 MB is 5 MB.
  size = Tuning().buffer_bytes
  assert buffer_plan(size, STOCK_WMEM, STOCK_MAX) == size
  # A 30 MB wish is capped at 2x wmem_max = 8 MiB, still more than 4 MiB.
  assert buffer_plan(30 * MiB, STOCK_WMEM, STOCK_MAX) == 30 * MiB


def test_neither_reaches_the_size_keeps_autotuning_and_says_which_sysctl(caplog):
  # 4 Gbit/s x 30 ms: 2x the BDP is 30 MB, a buffer of 60 MB; setsockopt would
  # lock 8 MiB, autotuning reaches 32 MiB.
  size = Tuning(rate_bytes_per_s=5e8, rtt_s=0.03).buffer_bytes
  tuning_lib._log_short_buffers.cache_clear()
  with caplog.at_level(logging.INFO, logger=tuning_lib.__name__):
    assert buffer_plan(size, STOCK_RMEM, STOCK_MAX) is None
    assert buffer_plan(size, STOCK_RMEM, STOCK_MAX) is None  # a second connection
  said = [r.getMessage() for r in caplog.records if r.name == tuning_lib.__name__]
  assert len(said) == 1  # once, not per connection
  assert "tcp_[rw]mem[2]" in said[0] and "net.core.[rw]mem_max" in said[0]


def test_unknown_limits_set_the_size():
  assert buffer_plan(3 * MiB, None, None) == 3 * MiB


def test_kernel_limits_read_proc_or_say_none(monkeypatch):
  if sys.platform == "linux":
    for direction in "rw":
      autotune_max, setsockopt_max = kernel_limits(direction)
      assert autotune_max > 0 and setsockopt_max > 0
  def missing(*args, **kwargs):
    raise FileNotFoundError("no /proc/sys here")
  monkeypatch.setattr("builtins.open", missing)
  assert kernel_limits("r") == (None, None)


def _is_locked(sock: socket.socket, default: int) -> bool:
  """Whether a fresh socket's receive buffer was set (it reads other than the
  default, tcp_rmem[1], that autotuning starts from)."""
  return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) != default


@pytest.mark.skipif(sys.platform != "linux", reason="Linux socket buffer semantics")
def test_apply_on_a_real_socket_follows_the_plan(monkeypatch):
  tuning = Tuning()
  autotune_max, setsockopt_max = kernel_limits("r")
  expected = buffer_plan(tuning.buffer_bytes, autotune_max, setsockopt_max)
  with socket.socket() as probe:
    default = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
  with socket.socket() as sock:
    tuning_lib.apply(sock, tuning)
    assert _is_locked(sock, default) == (expected is not None)
    if expected is not None:
      got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
      assert got == 2 * min(expected, setsockopt_max)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
  # Negative control: the policy before this one (always set) locks the buffer,
  # and the check above sees it.
  monkeypatch.setattr(tuning_lib, "buffer_plan", lambda size, *limits: size)
  with socket.socket() as sock:
    tuning_lib.apply(sock, tuning)
    assert _is_locked(sock, default)


# -- how many connections a link needs (tuning.lanes_for, SenderOptions(lanes=0)) ----


def test_lanes_for_is_one_and_a_half_bdp_over_one_connections_window():
  wan = Tuning(rate_bytes_per_s=5e8, rtt_s=0.03)  # 4 Gbit/s, 30 ms: 15 MB in flight
  assert tuning_lib.lanes_for(wan, 4 * MiB) == 6  # ceil(22.5 MB / 4 MiB)
  assert tuning_lib.lanes_for(Tuning(rate_bytes_per_s=1.25e9, rtt_s=0.03), 4 * MiB) == 14
  # The send buffer bounds a connection too: 16 MiB windows, 8 MiB buffers.
  assert tuning_lib.lanes_for(wan, 16 * MiB, send_reach=8 * MiB) == 3
  assert tuning_lib.lanes_for(wan, 16 * MiB) == 2
  # A LAN (the default Tuning: 10 Gbit/s, 1 ms) needs one; a huge BDP is capped.
  assert tuning_lib.lanes_for(Tuning(), 16 * MiB) == 1
  assert tuning_lib.lanes_for(Tuning(rate_bytes_per_s=1e11, rtt_s=0.1), MiB) == 32
  assert tuning_lib.lanes_for(Tuning(rate_bytes_per_s=1e11, rtt_s=0.1), MiB, max_lanes=5) == 5
  with pytest.raises(ValueError):
    tuning_lib.lanes_for(wan, 0)


def test_send_buffer_reach_follows_the_buffer_plan(monkeypatch):
  limits = {"w": (STOCK_WMEM, STOCK_MAX)}
  monkeypatch.setattr(tuning_lib, "kernel_limits", lambda d: limits[d])
  # 2.5 MB set explicitly (more than autotuning's 4 MiB once doubled): 5 MB.
  assert tuning_lib.send_buffer_reach(Tuning()) == 2 * Tuning().buffer_bytes
  # A 60 MB wish: setsockopt is capped at 2 x wmem_max.
  assert tuning_lib.send_buffer_reach(Tuning(rate_bytes_per_s=5e8, rtt_s=0.03)) == 8 * MiB
  # Autotuning kept (it reaches the size): its ceiling.
  limits["w"] = (64 * MiB, STOCK_MAX)
  assert tuning_lib.send_buffer_reach(Tuning()) == 64 * MiB
  limits["w"] = (None, None)
  assert tuning_lib.send_buffer_reach(Tuning()) is None


def test_sender_options_resolve_zero_lanes_from_their_link(monkeypatch):
  from paas_jax.transport import SenderOptions
  monkeypatch.setattr(tuning_lib, "kernel_limits", lambda d: (STOCK_WMEM, STOCK_MAX))
  wan = Tuning(rate_bytes_per_s=5e8, rtt_s=0.03)
  opts = SenderOptions(plane="tcp", lanes=0, window_bytes=4 * MiB, tuning=wan)
  assert opts.lanes == 6
  # 16 MiB windows, but the send buffer holds 8 MiB: 3 connections.
  assert SenderOptions(plane="tcp", lanes=0, tuning=wan).lanes == 3
  assert SenderOptions(plane="tcp", lanes=0).lanes == 1  # the default Tuning: a LAN
  assert SenderOptions(plane="tcp", lanes=3, tuning=wan).lanes == 3  # explicit stays
  with pytest.raises(ValueError, match="lanes"):
    SenderOptions(plane="tcp", lanes=-1)
