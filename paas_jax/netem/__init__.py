"""WAN emulation between the PrfaaS region (A) and the PD region (B).

* ``Link``/``LinkSpec``/``BandwidthTrace``: bandwidth (constant or over time),
  RTT and jitter, with per-direction byte accounting and utilization.
* ``Relay``: a userspace TCP relay that applies a link to real connections
  (works anywhere); ``SpliceRelay``: the same, forwarding in the kernel
  (Linux ``splice``), for high rates.
* ``NetnsLink``: where root and iproute2 allow, region A in a network
  namespace with tbf shaping on a veth pair (the relay then adds only delay).

Run a relay as its own process: ``python -m paas_jax.netem --help``.
"""

from paas_jax.netem.link import BandwidthTrace, Direction, Link, LinkSpec, describe, parse_rate
from paas_jax.netem.netns import NetnsLink, available as netns_available
from paas_jax.netem.relay import Relay, Route
from paas_jax.netem.splice_relay import SpliceRelay

__all__ = ["BandwidthTrace", "Direction", "Link", "LinkSpec", "NetnsLink", "Relay", "Route",
           "SpliceRelay", "describe", "netns_available", "parse_rate"]
