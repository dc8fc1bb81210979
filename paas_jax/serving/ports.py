"""Ports a launcher announces before their owner binds them.

A supervisor fixes a slice process's transfer and data-plane ports for the
slice's lifetime, a coordinator's port is handed to every process of a pod, and
the WAN relay listens on the same port number a decode server's data plane
binds on another loopback address. Between the choice and the bind, a port from
the kernel's ephemeral range can become any outgoing connection's local port
(seen: the relay's bind failing with EADDRINUSE under load), so these ports
are drawn below that range, where only another explicit bind competes.
"""

from __future__ import annotations

import pathlib
import secrets
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
FIXED_PORT_FLOOR = 20000  # below: ports services often hold (databases, dev servers)


def _ephemeral_ports() -> range:
  """The kernel's range for ports it picks itself (outgoing connections, bind to 0)."""
  try:
    low, high = map(int, pathlib.Path(EPHEMERAL_RANGE_FILE).read_text().split())
    return range(low, high + 1)
  except (OSError, ValueError):
    return range(32768, 61000)  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
  """A port that is free now on ``host`` for a process to bind later, drawn at
  random below the ephemeral range; the kernel's choice when that range is too
  small or the draws keep hitting ports in use."""
  ephemeral = _ephemeral_ports()
  below = range(FIXED_PORT_FLOOR, ephemeral.start)
  for _ in range(64 if len(below) >= 1024 else 0):
    port = below[secrets.randbelow(len(below))]
    with socket.socket() as s:
      try:
        s.bind((host, port))
      except OSError:
        continue
      return port
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]
