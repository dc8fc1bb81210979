"""ports.free_port: ports announced before their owner binds them are drawn
below the kernel's ephemeral range, where outgoing connections never land."""

from __future__ import annotations

import socket

from paas_jax.serving import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_free():
  ephemeral = ports._ephemeral_ports()
  for _ in range(20):
    port = ports.free_port()
    assert ports.FIXED_PORT_FLOOR <= port < ephemeral.start
    with socket.socket() as s:
      s.bind(("127.0.0.1", port))  # free now: the next owner can take it


def _hold_a_port_below_the_range(held: socket.socket, below: range) -> int:
  for port in below:
    try:
      held.bind(("127.0.0.1", port))
    except OSError:
      continue
    held.listen()
    return port
  raise AssertionError("no port below the ephemeral range is free")


def test_a_port_in_use_is_skipped(monkeypatch):
  below = range(ports.FIXED_PORT_FLOOR, ports._ephemeral_ports().start)
  with socket.socket() as held:
    taken = _hold_a_port_below_the_range(held, below)
    # The draw hits the held port first, then another one: the held one is skipped.
    draws = iter([taken - below.start, taken - below.start + 1])
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: next(draws))
    assert ports.free_port() == taken + 1
    # Negative control: a draw that only ever hits the held port falls back to the
    # kernel's choice instead of answering a port in use.
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: taken - below.start)
    port = ports.free_port()
    assert port != taken and port >= ports._ephemeral_ports().start


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
  monkeypatch.setattr(ports, "_ephemeral_ports", lambda: range(20100, 61000))
  port = ports.free_port()  # 100 ports below: too few to draw from
  with socket.socket() as s:
    s.bind(("127.0.0.1", port))
