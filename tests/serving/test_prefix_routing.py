"""The broker routes a local request to where its prefix is cached.

The real broker (routing, ``AttemptRunner``, ``NodePool``) and the real live
view's probe (``LiveClusterState.probe_prefix_nodes``) in front of fake PD
nodes whose ProbePrefix answers from a table: node 0 a decode slice ("both"),
node 1 a single PD-D node, node 2 a single PD-P node (``test_slice_pd_nodes``'s
fake region). A prompt of 120 tokens against a threshold of 100 offloads
unless a PD node holds a prefix; then only its uncached tail counts, it stays
local, and it is prefilled where that prefix lives: on the slice itself, or by
PD-P node 2 for PD-D node 1. The negative control is the same requests with
the probe's node list dropped (the broker of before): they spread over the
nodes by load, so prefills miss the cache. A prompt whose tail alone still
offloads is decoded on a holder that keeps the prefix for it (region A then
sends only the rest), never on the slice for that reason.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest

from paas_jax.proto import serving_pb2
from paas_jax.serving.live_view import LiveClusterState
from paas_jax.serving.node_pool import NodeKind
from tests.serving.test_slice_pd_nodes import _broker, _context

PREFIX = list(range(1, 97))  # 96 cached tokens
PROMPT = PREFIX + list(range(200, 224))  # 120 tokens: > t = 100, its tail 24 <= t


class _ProbedNode:
  """A server's ProbePrefix over a fixed cached prefix (ids probes: the live
  view has learned no block size, as before its first poll)."""

  def __init__(self, cached: list[int]):
    self.cached = cached
    self.ProbePrefix = self

  def future(self, req, timeout=None):
    del timeout
    ids, n = list(req.prompt_ids), len(self.cached)
    hit = n if self.cached and ids[:n] == self.cached and len(ids) > n else 0
    fut = concurrent.futures.Future()
    fut.set_result(serving_pb2.PrefixProbeResponse(cached_tokens=hit))
    return fut


def _routed_broker(holders: set[int], *, forget_nodes: bool = False):
  """``_broker`` with a live view probing fake nodes; ``holders`` hold PREFIX."""
  b, region = _broker()
  live = LiveClusterState([_ProbedNode([])],
                          [_ProbedNode(PREFIX if i in holders else []) for i in range(3)],
                          link_bandwidth_bps=1e9)
  if forget_nodes:
    probe_nodes = live.probe_prefix_nodes
    live.probe_prefix_nodes = lambda prompt: dataclasses.replace(probe_nodes(prompt),
                                                                 pd_nodes=())
  b.live = live  # not started: probes only, no polls
  return b, region


def _generate(b, n: int, prompt=PROMPT, tag: str = "r") -> list:
  """Records of ``n`` auto-routed requests of ``prompt``."""
  out = []
  for k in range(n):
    req = serving_pb2.GenerateRequest(prompt_ids=prompt, max_new_tokens=2,
                                      route=serving_pb2.ROUTE_AUTO, request_id=f"{tag}{k}")
    assert list(b.Generate(req, _context()))[-1].finished
    out.append(next(r for r in b._recent if r.request_id == req.request_id))
  return out


def _where(b, records) -> tuple[set, set]:
  """(the PD nodes that decoded ``records``, those that prefilled for another)."""
  node = {t.control: i for i, t in enumerate(b.pool.decode_targets)}
  return ({node[r.decode_server] for r in records},
          {node.get(r.prefill_server, r.prefill_server) for r in records if r.pd_split})


@pytest.mark.parametrize("holders, decoded_on, prefilled_by", [
    ({0}, {0}, set()),      # the slice: it prefills its own local requests
    ({2}, {1}, {2}),        # PD-P node 2 for PD-D node 1 (never into the slice)
    ({0, 2}, {0, 1}, {2}),  # both hold it: both are used
])
def test_a_local_request_is_prefilled_where_its_prefix_is_cached(holders, decoded_on,
                                                                 prefilled_by):
  b, region = _routed_broker(holders)
  try:
    records = _generate(b, 4)
    assert all(r.route == "pdp" and r.l_pd_cached == len(PREFIX) for r in records)
    assert all(set(r.pd_prefix_nodes) == holders for r in records)
    assert _where(b, records) == (decoded_on, prefilled_by)
    # A prompt no node holds offloads (l = 120 > t): the probe decides, not the ids.
    other = _generate(b, 1, prompt=[7] + PROMPT[1:], tag="other")[0]
    assert other.route == "prfaas" and other.l_pd_cached == 0 and not other.pd_prefix_nodes
  finally:
    b.close()


def test_negative_control_without_the_holders_prefills_miss_the_cache():
  # The same four requests with only the lengths (the broker of before): still
  # local, but spread by load: the slice (node 0) and node 1 through node 2.
  b, region = _routed_broker({2}, forget_nodes=True)
  try:
    records = _generate(b, 4)
    assert all(r.route == "pdp" and not r.pd_prefix_nodes for r in records)
    decoded_on, _ = _where(b, records)
    assert 0 in decoded_on  # prefilled on the slice, whose cache has no such prefix
  finally:
    b.close()


LONG = PREFIX + [100 + i % 150 for i in range(150)]  # 246 tokens: its tail (150) offloads


@pytest.mark.parametrize("holders, decoded_on", [
    ({1}, {1}),       # PD-D node 1 keeps the prefix for a remote request
    ({0}, {0, 1}),    # the slice keeps none for remote requests: no preference
])
def test_a_remote_request_is_decoded_where_its_prefix_is_held(holders, decoded_on):
  b, _ = _routed_broker(holders)
  try:
    records = _generate(b, 4, prompt=LONG)
    assert all(r.route == "prfaas" and set(r.pd_prefix_nodes) == holders for r in records)
    assert _where(b, records)[0] == decoded_on
  finally:
    b.close()


@pytest.mark.parametrize("busy", [4, 5])
def test_a_busy_holder_gives_way_past_the_affinity_balance(busy):
  """The slice (node 0) holds the prefix but already carries ``busy``
  requests the broker routed earlier (held by hard picks, as a resume's
  are). With 4 (within abs_load) the request still goes to the slice; with 5
  it goes to PD-D node 1 (prefilled by PD-P node 2), the cache missed for
  load's sake, and the broker counts it. A resume's hard preference would
  not yield (``test_node_pool``)."""
  b, _ = _routed_broker({0})
  try:
    held = [b.pool.pick(NodeKind.DECODE, prefer=0) for _ in range(busy)]
    assert held == [0] * busy
    decoded_on, prefilled_by = _where(b, _generate(b, 1))
    assert (decoded_on, prefilled_by) == (({0}, set()) if busy == 4 else ({1}, {2}))
    assert b.counters["affinity_yielded"] == (busy == 5)
  finally:
    b.close()
