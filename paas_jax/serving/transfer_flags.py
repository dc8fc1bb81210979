"""Flags of region A's state transfers (prefill server and prefill pod) and
the ``SenderOptions`` they give.

The link flags size the data plane for the path the states cross: socket
buffers from its bandwidth-delay product, the congestion control, and with
``--transfer_lanes=0`` the number of connections
(``dataplane.tuning.lanes_for``). Left at their defaults they describe a
10 Gbit/s, 1 ms path (the library's ``Tuning``); over a WAN, a send buffer
sized for that holds ~5 MB, i.e. ~170 MB/s per connection at 30 ms.
"""

from __future__ import annotations

from absl import flags

from paas_jax.transport import SenderOptions
from paas_jax.transport.dataplane.tuning import Tuning


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines the transfer flags in ``flag_values``."""
  fv = flag_values
  flags.DEFINE_integer("transfer_streams", 2, "Parallel Push streams per transfer "
                       "(transfer_plane=grpc).", flag_values=fv)
  flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "What carries state bytes to "
                    "decode servers: tcp (the data plane, when the receiver announces one) or "
                    "grpc (Push streams). On tcp, Begin and Commit ride the data plane once the "
                    "decode server announces it takes them; Abort stays on gRPC.",
                    flag_values=fv)
  flags.DEFINE_integer("transfer_lanes", 2, "Data-plane connections per transfer "
                       "(transfer_plane=tcp); 0: as many as the link needs (1.5x its "
                       "bandwidth-delay product over --transfer_window_mib, at most 32).",
                       lower_bound=0, flag_values=fv)
  flags.DEFINE_float("transfer_link_gbit", 10.0, "Rate of the path to the decode regions, "
                     "Gbit/s: sizes the data plane's socket buffers (and lanes with "
                     "--transfer_lanes=0).", lower_bound=1e-3, flag_values=fv)
  flags.DEFINE_float("transfer_rtt_ms", 1.0, "Round-trip time of that path, ms.",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_integer("transfer_window_mib", 16, "Unacknowledged MiB per data-plane "
                       "connection.", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("transfer_congestion", "", "TCP congestion control of the data plane "
                      "(e.g. bbr; a name the kernel lacks is logged and ignored; empty: the "
                      "system default).", flag_values=fv)


def sender_options(flag_values: flags.FlagValues = flags.FLAGS) -> SenderOptions:
  """``SenderOptions`` of the parsed transfer flags (no credentials: the
  servers add their own)."""
  fv = flag_values
  link = Tuning(rate_bytes_per_s=fv.transfer_link_gbit * 1e9 / 8,
                rtt_s=fv.transfer_rtt_ms / 1e3,
                congestion=fv.transfer_congestion or None)
  return SenderOptions(num_streams=fv.transfer_streams, plane=fv.transfer_plane,
                       lanes=fv.transfer_lanes, window_bytes=fv.transfer_window_mib << 20,
                       tuning=link)


def announced(opts: SenderOptions) -> dict:
  """What a server's ready file says of its transfers: the data plane's lanes
  as resolved (``--transfer_lanes=0``: from the link) and the link they are
  sized for."""
  return {"transfer_plane": opts.plane, "transfer_lanes": opts.lanes,
          "transfer_window_bytes": opts.window_bytes,
          "transfer_link_bytes_per_s": opts.tuning.rate_bytes_per_s,
          "transfer_rtt_s": opts.tuning.rtt_s}


def link_args(bandwidth_bps: float, rtt_s: float) -> list[str]:
  """The link flags for a path of ``bandwidth_bps`` and ``rtt_s``."""
  return [f"--transfer_link_gbit={bandwidth_bps / 1e9:g}", f"--transfer_rtt_ms={rtt_s * 1e3:g}"]
