"""Region A's transfer flags (serving/transfer_flags.py): what SenderOptions
they give, and the link flags a cluster passes to its prefill server."""

import pytest
from absl import flags

from paas_jax.netem.link import LinkSpec
from paas_jax.serving import launch_args, transfer_flags
from paas_jax.serving.launch import ClusterSpec
from paas_jax.transport import SenderOptions
from paas_jax.transport.dataplane import tuning as tuning_lib
from paas_jax.transport.dataplane.tuning import Tuning

MiB = 1 << 20


def _parsed(*argv: str) -> flags.FlagValues:
  fv = flags.FlagValues()
  transfer_flags.define_flags(fv)
  fv(["prefill_server", *argv])
  return fv


def test_defaults_are_the_librarys_link_and_two_lanes():
  opts = transfer_flags.sender_options(_parsed())
  assert opts.tuning == Tuning() and opts.window_bytes == SenderOptions().window_bytes
  assert (opts.plane, opts.lanes, opts.num_streams) == ("tcp", 2, 2)


def test_link_flags_size_buffers_and_lanes(monkeypatch):
  # A stock kernel's send side: autotuning to 4 MiB, setsockopt to 2 x 4 MiB.
  monkeypatch.setattr(tuning_lib, "kernel_limits", lambda d: (4 * MiB, 4 * MiB))
  opts = transfer_flags.sender_options(_parsed(
      "--transfer_link_gbit=4", "--transfer_rtt_ms=30", "--transfer_window_mib=4",
      "--transfer_congestion=bbr", "--transfer_lanes=0"))
  assert opts.tuning == Tuning(rate_bytes_per_s=5e8, rtt_s=0.03, congestion="bbr")
  assert opts.window_bytes == 4 * MiB
  assert opts.tuning.buffer_bytes == 30_000_000  # 2x the 15 MB bandwidth-delay product
  assert opts.lanes == 6  # ceil(1.5 x 15 MB / 4 MiB)
  # An explicit count is kept whatever the link.
  assert transfer_flags.sender_options(_parsed("--transfer_rtt_ms=30",
                                               "--transfer_lanes=3")).lanes == 3


@pytest.mark.parametrize("bad", ["--transfer_link_gbit=0", "--transfer_rtt_ms=-1",
                                 "--transfer_lanes=-1", "--transfer_window_mib=0"])
def test_out_of_range_flags_are_refused(bad):
  with pytest.raises(flags.IllegalFlagValueError):
    _parsed(bad)


def test_a_cluster_passes_its_widest_link_to_the_prefill_server():
  def link_flags(spec):
    return [a for a in launch_args.prefill_args(spec, "127.0.0.1")
            if a.startswith(("--transfer_link_gbit", "--transfer_rtt_ms"))]

  assert link_flags(ClusterSpec()) == []  # no emulated link: the defaults
  assert link_flags(ClusterSpec(link=LinkSpec(bandwidth_bps=0.0))) == []  # unshaped
  one = ClusterSpec(link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  assert link_flags(one) == ["--transfer_link_gbit=0.2", "--transfer_rtt_ms=10"]
  # Two decode regions: the larger bandwidth-delay product (C's 1 Gbit/s x 30 ms).
  two = ClusterSpec(decode_regions=2, region_links=(
      LinkSpec(bandwidth_bps=4e9, rtt_s=0.005), LinkSpec(bandwidth_bps=1e9, rtt_s=0.03)))
  assert link_flags(two) == ["--transfer_link_gbit=1", "--transfer_rtt_ms=30"]
  # What the flags give back is the link's own Tuning.
  opts = transfer_flags.sender_options(_parsed(*link_flags(two)))
  assert opts.tuning == Tuning(rate_bytes_per_s=1e9 / 8, rtt_s=0.03)
