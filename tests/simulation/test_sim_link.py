"""Fair-shared link: hand-computed completion times and byte conservation."""

import numpy as np
import pytest

from paas_jax.simulation.events import EventLoop
from paas_jax.simulation.link import BandwidthTrace, Link


def _run(trace, transfers):
  """transfers: (start_s, bytes). Returns (completion times in order of transfers, link)."""
  loop = EventLoop()
  link = Link(loop, trace)
  done = {}
  for i, (t0, n) in enumerate(transfers):
    loop.schedule(t0, lambda i=i, n=n: link.start(n, lambda now, i=i: done.__setitem__(i, now)))
  loop.run()
  return [done[i] for i in range(len(transfers))], link


def test_single_transfer_takes_size_over_bandwidth():
  (t,), link = _run(BandwidthTrace.constant(8e9), [(0.0, 2e9)])  # 1 GB/s
  assert t == pytest.approx(2.0)
  assert link.bytes_delivered == pytest.approx(2e9)


def test_staggered_transfers_share_fairly():
  # 8 b/s = 1 B/s. A: 10 B at t=0; B: 4 B at t=2. A alone for 2 s (8 B left), then both at
  # 0.5 B/s: B done after 8 s (t=10) with A at 4 B left, then A alone: t=14.
  (ta, tb), link = _run(BandwidthTrace.constant(8.0), [(0.0, 10.0), (2.0, 4.0)])
  assert tb == pytest.approx(10.0)
  assert ta == pytest.approx(14.0)
  assert link.bytes_delivered == pytest.approx(14.0)


def test_equal_transfers_finish_together():
  (a, b, c), _ = _run(BandwidthTrace.constant(8.0), [(0.0, 5.0)] * 3)
  assert a == pytest.approx(15.0) and b == pytest.approx(15.0) and c == pytest.approx(15.0)


def test_bandwidth_trace_changes_rates():
  # 1 B/s for 5 s (5 B), then 0.5 B/s: the remaining 5 B take 10 s -> t = 15.
  (t,), _ = _run(BandwidthTrace((0.0, 5.0), (8.0, 4.0)), [(0.0, 10.0)])
  assert t == pytest.approx(15.0)
  # Link down during [2, 6): 2 B before, then 8 B after t=6 -> t = 14.
  (t,), _ = _run(BandwidthTrace((0.0, 2.0, 6.0), (8.0, 0.0, 8.0)), [(0.0, 10.0)])
  assert t == pytest.approx(14.0)


def test_random_transfers_conserve_bytes():
  rng = np.random.default_rng(3)
  starts = np.sort(rng.uniform(0, 50, 200))
  sizes = rng.uniform(1e6, 2e9, 200)
  trace = BandwidthTrace.with_drop(20e9, start_s=10.0, duration_s=15.0, factor=0.25)
  times, link = _run(trace, list(zip(starts, sizes)))
  total = float(sizes.sum())
  assert link.bytes_requested == pytest.approx(total, rel=1e-12)
  assert link.bytes_delivered == pytest.approx(total, rel=1e-9)
  _, bins = link.delivered_series()
  assert bins.sum() == pytest.approx(total, rel=1e-9)
  # Never faster than the link: each bin carries at most its capacity.
  caps = np.array([trace.capacity_bits(k * 1.0, (k + 1) * 1.0) / 8 for k in range(bins.size)])
  assert np.all(bins <= caps * (1 + 1e-9) + 1e-3)
  assert all(t >= s for t, s in zip(times, starts))
  assert link.transfers_completed == 200 and link.active_transfers == 0


def test_utilization_is_busy_fraction_of_window():
  loop = EventLoop()
  link = Link(loop, BandwidthTrace.constant(8.0))
  loop.schedule(0.0, lambda: link.start(4.0, lambda now: None))  # busy during [0, 4]
  loop.run()
  assert link.utilization(10.0, 10.0) == pytest.approx(0.4)
  assert link.utilization(10.0, 5.0) == pytest.approx(0.0)


def test_trace_validation():
  with pytest.raises(ValueError):
    BandwidthTrace((1.0,), (1.0,))
  with pytest.raises(ValueError):
    BandwidthTrace((0.0, 0.0), (1.0, 2.0))
  with pytest.raises(ValueError):
    BandwidthTrace((0.0,), (-1.0,))
  with pytest.raises(ValueError):
    Link(EventLoop(), BandwidthTrace.constant(1.0)).start(-5.0, lambda now: None)
