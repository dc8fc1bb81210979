"""A decode slice's prefix cache for its local prefills (``slice_prefix``), in one
process whose slice mesh spans two devices (heads split two ways).

A local request whose prompt shares a cached prefix continues the sharded
prefill from the cached sharded state, token- and logprob-exact against
single-process generation, and the stats count the hit and the tokens
saved; corrupting a cached KV block or recurrent checkpoint changes what the
hit produces (the cache is what the output came from). Each process keeps
only its own shards: two caches over one device each hold half the heads and
together give back the whole cached state. Processes whose caches differ
all refuse the prefill before any collective (and agree when they do not).
Under a byte budget of a few blocks, evictions keep every request exact.
And (slow) a real slice of two processes, one device each, behind the broker:
two local requests sharing a prefix, the second a hit, token-exact.
"""

from __future__ import annotations

import collections
import threading
import time
import types

import grpc
import jax
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common, lockstep, logprob_check, pod
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.slice_batch import SliceBatch, SliceRound
from paas_jax.serving.slice_decode import SliceJob, SliceParts
from paas_jax.serving.slice_decode_server import SliceDecodeServicer
from paas_jax.serving.slice_prefix import PrefixDisagreement, SlicePrefix
from paas_jax.serving.validation import RequestParams
from paas_jax.state.prefix_cache import block_hashes, probe_tokens
from tests.serving.test_pod import pod_config

CONFIG = pod_config("tiny_gdn_gqa")  # GDN (checkpoints) and attention (KV blocks), split 2 ways
BLOCK = 16


@pytest.fixture(scope="module")
def model():
  return api.Model.create(CONFIG, 0)


@pytest.fixture(scope="module")
def mesh():
  return pod.region_mesh(jax.devices()[2:4])


@pytest.fixture(scope="module")
def sharded(model, mesh):
  return pod.shard_model(model, mesh)


def _batch(sharded, mesh, capacity_bytes=1 << 30):
  prefix = SlicePrefix(CONFIG, mesh, BLOCK, capacity_bytes)
  return SliceBatch(sharded, mesh, pod.RegionSpec("", 1, 0, 2), SliceParts(0), slots=2,
                    prefix=prefix)


def _tokens(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(900 + salt).integers(1, 256, n)]


SHARED = _tokens(3 * BLOCK, 0)  # three whole blocks


def _params(temperature=0.0, seed=0, max_new=6):
  return RequestParams(sampling=api.SamplingParams(temperature, 0, 1.0), seed=seed,
                       max_new_tokens=max_new, logprobs=2)


def _local(batch, number, rid, prompt, params):
  """One round: the local request admitted alone and decoded to its end;
  returns (prompt tokens from the cache, tokens, logprobs, slot info)."""
  events = collections.defaultdict(list)
  job = SliceJob.from_request(number, rid, len(prompt), params, prompt=tuple(prompt))
  report = batch.run_round(SliceRound(number, ((0, job),), steps=64),
                           emit=lambda r, *ev: events[r].append(ev))
  assert report["ok"] and not report["failed"], report
  tokens = [e[1] for e in events[rid] if e[0] == "token"]
  assert report["finished"][rid]["tokens"] == tokens
  slot = next(e[1] for e in events[rid] if e[0] == "slot")
  return report["prefix"][rid], tokens, [e[2] for e in events[rid] if e[0] == "token"], slot


def _reference(model, prompt, params):
  want = api.generate(model, list(prompt), params.max_new_tokens, sampling=params.sampling,
                      seed=params.seed).tokens
  return want, logprob_check.reference_logprobs(model, list(prompt), want)


def test_a_local_prefill_continues_from_a_cached_prefix_token_and_logprob_exact(
    model, sharded, mesh):
  batch = _batch(sharded, mesh)
  first, second = SHARED + _tokens(9, 1), SHARED + _tokens(13, 2)
  for number, (rid, prompt, params, cached) in enumerate(
      [("a", first, _params(), 0), ("b", second, _params(0.8, 5), len(SHARED))], 1):
    got, tokens, lps, slot = _local(batch, number, rid, prompt, params)
    assert got == cached and slot["cached_tokens"] == cached, rid
    want, ref = _reference(model, prompt, params)
    assert tokens == want, rid
    cmp = logprob_check.compare(lps, ref)
    assert cmp.ok and cmp.steps == params.max_new_tokens, (rid, cmp)
  gauges = common.prefix_cache_gauges(batch.prefix)
  assert gauges["prefix_cache_enabled"] == 1.0 and gauges["prefix_block"] == BLOCK
  assert (gauges["prefix_hits"], gauges["prefix_misses"]) == (1.0, 1.0)
  assert gauges["prefix_hit_tokens"] == len(SHARED)
  # The first prompt's 3 whole blocks (57 tokens) and the second's: shared, no new one.
  assert gauges["prefix_blocks"] == 3 and gauges["prefix_checkpoints"] == 3
  assert batch.state is None and batch.active() == 0


def _programs(*names) -> set:
  return {k for k in pod._COMPILED if k[0] in names}  # pylint: disable=protected-access


def test_a_precompiled_slice_compiles_no_step_or_insert_in_its_rounds(
    model, sharded, mesh, monkeypatch):
  """``SliceBatch.precompile`` compiles every width's and context octave's step
  and row insert up front (no execution); rounds then only run them, token-exact.
  Negative control: without it the same round compiles both."""
  prompt, params = _tokens(40, 50), _params()
  want, _ = _reference(model, prompt, params)
  monkeypatch.setattr(pod, "_COMPILED", {})
  batch = _batch(sharded, mesh)
  # Widths 1 and 2 (two slots), context octaves 64 .. 256 (max_ctx 128 -> 256):
  # a step and an insert per pair, a handoff probe per octave.
  assert batch.precompile(max_ctx=128) == 2 * 3 * 2 + 3
  assert batch.precompile(max_ctx=128) == 0  # all there already
  before = _programs("slice_step", "slice_insert")
  _, tokens, _, _ = _local(batch, 1, "a", prompt, params)
  assert tokens == want
  assert _programs("slice_step", "slice_insert") == before
  monkeypatch.setattr(pod, "_COMPILED", {})
  cold = _batch(sharded, mesh)
  _, tokens, _, _ = _local(cold, 1, "b", prompt, params)
  assert tokens == want
  assert {k[0] for k in _programs("slice_step", "slice_insert")} == {"slice_step",
                                                                     "slice_insert"}


class _AbortContext:
  def abort(self, code, details):
    raise grpc.RpcError(code, details)


def test_the_broker_can_probe_the_slices_cache(model, sharded, mesh):
  """Process 0's Decode service answers ProbePrefix from its cache, by ids and by
  the block hashes GetLoad's announcement lets the broker send; ExportPrefix
  stays refused. A slice without a cache announces none and refuses probes."""
  batch = _batch(sharded, mesh)
  leader = types.SimpleNamespace(batch=batch, rows_busy=0, queue_depth=0)
  servicer = SliceDecodeServicer(CONFIG, leader, serving_pb2.DecodeSlice(), max_ctx=256)
  prompt = SHARED + _tokens(6, 30)
  probe = serving_pb2.PrefixProbeRequest(prompt_ids=prompt)
  assert servicer.ProbePrefix(probe, _AbortContext()).cached_tokens == 0
  _local(batch, 1, "a", SHARED + _tokens(5, 31), _params())
  assert servicer.ProbePrefix(probe, _AbortContext()).cached_tokens == len(SHARED)
  info = servicer.GetLoad(serving_pb2.LoadRequest(), None).prefix_cache
  assert (info.enabled, info.block_tokens) == (True, BLOCK)
  hashes = block_hashes(probe_tokens(prompt), info.block_tokens, info.config_fingerprint)
  hashed = serving_pb2.PrefixProbeRequest(block_hashes=hashes, block_tokens=BLOCK)
  assert servicer.ProbePrefix(hashed, _AbortContext()).cached_tokens == len(SHARED)
  # Negative control: another prompt of the same length is a miss.
  other = serving_pb2.PrefixProbeRequest(prompt_ids=_tokens(len(prompt), 32))
  assert servicer.ProbePrefix(other, _AbortContext()).cached_tokens == 0
  with pytest.raises(grpc.RpcError) as e:
    servicer.ExportPrefix(serving_pb2.ExportPrefixRequest(), _AbortContext())
  assert e.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
  bare = SliceDecodeServicer(CONFIG, types.SimpleNamespace(
      batch=types.SimpleNamespace(prefix=None, slots=2), rows_busy=0, queue_depth=0),
      serving_pb2.DecodeSlice(), max_ctx=256)
  assert not bare.GetLoad(serving_pb2.LoadRequest(), None).prefix_cache.enabled
  with pytest.raises(grpc.RpcError) as e:
    bare.ProbePrefix(probe, _AbortContext())
  assert e.value.args == (grpc.StatusCode.FAILED_PRECONDITION,
                          "ProbePrefix: this server has no prefix cache")


@pytest.mark.parametrize("part", ["block", "checkpoint"])
def test_negative_control_a_corrupted_cache_entry_changes_what_a_hit_serves(
    model, sharded, mesh, part):
  batch = _batch(sharded, mesh)
  _local(batch, 1, "a", SHARED + _tokens(5, 3), _params())
  cache = batch.prefix.prefix_cache
  hashes = cache.block_hashes(SHARED)
  if part == "block":  # the attention layer's KV of the first block
    entry = cache._blocks[hashes[0]]  # pylint: disable=protected-access
    entry.kv = jax.tree_util.tree_map(lambda x: -x, entry.kv)
  else:  # the recurrent layers' state after the shared prefix
    entry = cache._checkpoints[hashes[-1]]  # pylint: disable=protected-access
    entry.layers = jax.tree_util.tree_map(lambda x: x * 3.0 + 0.5, entry.layers)
  prompt, params = SHARED + _tokens(11, 4), _params()
  cached, tokens, lps, _ = _local(batch, 2, "b", prompt, params)
  assert cached == len(SHARED)  # served from the corrupted entry
  want, ref = _reference(model, prompt, params)
  cmp = logprob_check.compare(lps, ref)
  assert tokens != want or not cmp.ok, (tokens, want, cmp)
  # The same prompt on a fresh cache (a miss) is exact: the corruption did it.
  fresh = _batch(sharded, mesh)
  cached, tokens, lps, _ = _local(fresh, 1, "c", prompt, params)
  assert cached == 0 and tokens == want and logprob_check.compare(lps, ref).ok


def test_each_process_keeps_only_its_own_shards_and_together_they_give_the_state_back(
    sharded, mesh):
  """Two caches over one device each (slice processes 0 and 1 of a mesh that
  spans them) store the same inserts; each holds its own heads, and their
  parts of a lookup make the same global state as a cache over both devices."""
  whole = SlicePrefix(CONFIG, mesh, BLOCK, 1 << 30)
  halves = [SlicePrefix(CONFIG, mesh, BLOCK, 1 << 30, devices=[d])
            for d in mesh.devices.flat]
  capacity = 128
  _, state = pod.region_prefill_logits(sharded, mesh, SHARED, capacity=capacity)
  for p in [whole, *halves]:
    p.insert(SHARED, state)
  # Heads split two ways: each half keeps fewer bytes than the whole; the
  # replicated leaves (lengths) are whole on both.
  assert all(h.prefix_cache.stats.nbytes < whole.prefix_cache.stats.nbytes for h in halves)
  assert halves[0].stats_key() == halves[1].stats_key()
  prompt = SHARED + [7]
  _, want = whole.prefix_cache.lookup(prompt, capacity=capacity)
  want = whole.assemble(capacity, [whole.shards(want, capacity)])
  parts = [h.shards(h.prefix_cache.lookup(prompt, capacity=capacity)[1], capacity)
           for h in halves]
  got = halves[0].assemble(capacity, parts)
  for a, b, c in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                     jax.tree_util.tree_leaves(state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if a.ndim >= 2 and a.shape[1] == capacity:  # KV: the cached 48 positions are the state's
      np.testing.assert_array_equal(np.asarray(a)[:, :len(SHARED)],
                                    np.asarray(c)[:, :len(SHARED)])
  # Negative control: process 0's part in place of process 1's is not the state.
  d0, d1 = halves[0].devices[0], halves[1].devices[0]
  swapped = [{d1: jax.device_put(leaf[d0], d1)} for leaf in parts[0]]
  bad = halves[0].assemble(capacity, [parts[0], swapped])
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree_util.tree_leaves(bad), jax.tree_util.tree_leaves(want)))


class _KV:
  """The region's key-value store as ``lockstep.agree`` uses it, in memory."""

  def __init__(self):
    self._cv = threading.Condition()
    self._data: dict[str, str] = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    with self._cv:
      assert allow_overwrite or key not in self._data, key
      self._data[key] = value
      self._cv.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self._cv:
      if not self._cv.wait_for(lambda: key in self._data, timeout_ms / 1000):
        raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
      return self._data[key]


def _prefill_in_lockstep(sharded, mesh, caches, prompt, key):
  """Every cache's ``prefill`` of ``prompt`` at once, as slice processes that
  agree through one store; returns each one's (logits, cached) or exception."""
  kv, out = _KV(), [None] * len(caches)

  def run(p):
    agree = lambda mine: lockstep.agree(kv, key, p, len(caches), 30.0, mine)
    try:
      logits, _, cached = caches[p].prefill(sharded, prompt, 128,
                                            lambda name, after_compile=False: None, agree)
      out[p] = (logits, cached)
    except PrefixDisagreement as e:
      out[p] = e
  threads = [threading.Thread(target=run, args=(p,)) for p in range(len(caches))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  return out


def test_processes_whose_caches_differ_refuse_the_prefill_before_any_collective(
    sharded, mesh):
  caches = [SlicePrefix(CONFIG, mesh, BLOCK, 1 << 30) for _ in range(2)]
  _, state = pod.region_prefill_logits(sharded, mesh, SHARED, capacity=128)
  for p in caches:
    p.insert(SHARED, state)
  prompt = SHARED + _tokens(6, 5)
  # The same caches: both reuse the prefix and compute the same logits.
  out = _prefill_in_lockstep(sharded, mesh, caches, prompt, "r/1")
  assert [o[1] for o in out] == [len(SHARED)] * 2
  np.testing.assert_array_equal(out[0][0], out[1][0])
  # Process 1's cache lost the checkpoint (e.g. an eviction process 0 did not
  # do): it would prefill from 0 and process 0 from 48. Both refuse.
  cache1 = caches[1].prefix_cache
  cache1._checkpoints.pop(cache1.block_hashes(SHARED)[-1])  # pylint: disable=protected-access
  out = _prefill_in_lockstep(sharded, mesh, caches, SHARED + _tokens(7, 6), "r/2")
  assert all(isinstance(o, PrefixDisagreement) for o in out), out
  assert "disagree" in str(out[0]) and caches[0].prefix_prompts == 1  # nothing looked up


def _serve_all(model, batch, prompts) -> list[int]:
  """Serves ``prompts`` one after the other, each token- and logprob-exact;
  returns the tokens each took from the cache."""
  cached = []
  for number, prompt in enumerate(prompts, 1):
    params = _params(0.7 if number % 2 else 0.0, number, 5)
    got, tokens, lps, _ = _local(batch, number, f"r{number}", prompt, params)
    want, ref = _reference(model, prompt, params)
    assert tokens == want, number
    assert logprob_check.compare(lps, ref).ok, number
    cached.append(got)
  return cached


def test_evictions_under_a_small_budget_keep_every_request_exact(model, sharded, mesh):
  one = SlicePrefix(CONFIG, mesh, BLOCK, 1 << 30)
  _, state = pod.region_prefill_logits(sharded, mesh, SHARED[:BLOCK], capacity=64)
  one.insert(SHARED[:BLOCK], state)
  per_block = one.prefix_cache.stats.nbytes  # one block and its checkpoint
  other = _tokens(3 * BLOCK, 7)
  # Two prefixes alternate; each prompt caches its 3 blocks and checkpoints.
  prompts = [SHARED + _tokens(5, 8), other + _tokens(4, 9), SHARED + _tokens(6, 10),
             other + _tokens(3, 11), SHARED + _tokens(9, 12)]
  # Room for both: every prompt after the first of its prefix is a hit.
  roomy = _batch(sharded, mesh)
  assert _serve_all(model, roomy, prompts) == [0, 0, 48, 48, 48]
  # Room for 4 blocks with checkpoints: the other prefix's inserts evict the
  # checkpoints (they go first) of this one, so every prompt misses, exact.
  small = _batch(sharded, mesh, capacity_bytes=4 * per_block)
  assert _serve_all(model, small, prompts) == [0] * 5
  st = small.prefix.prefix_cache.stats
  assert st.nbytes <= 4 * per_block and st.checkpoints < roomy.prefix.prefix_cache.stats.checkpoints
  assert common.prefix_cache_gauges(small.prefix)["prefix_misses"] == 5
  # What survived is the last prompt's: the same prefix again is a hit, exact.
  params = _params(0.0, 6, 5)
  got, tokens, lps, _ = _local(small, 6, "again", prompts[-1], params)
  want, ref = _reference(model, prompts[-1], params)
  assert got == len(SHARED) and tokens == want and logprob_check.compare(lps, ref).ok


@pytest.mark.slow  # its own cluster: a one-process pod and a slice of two start and compile
@pytest.mark.timeout(1200)
def test_a_real_slice_reuses_a_prefix_across_local_requests_token_exact(
    tmp_path, reference, assert_logprobs):
  # The adaptive router probes both regions' prefix caches before it routes.
  spec = ClusterSpec(n_slots=2, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, decode_slice=2, prefix_block=BLOCK,
                     router="adaptive")
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    assert f"--prefix_block={BLOCK}" in cluster.procs["decode"].args
    shared = _tokens(3 * BLOCK, 20)
    with BrokerClient(cluster.broker_address, timeout_s=300,
                      credentials=cluster.client_credentials()) as client:
      for i, (tail, temperature) in enumerate([(_tokens(7, 21), 0.0), (_tokens(12, 22), 0.8)]):
        prompt = shared + tail
        out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="local",
                              request_id=f"prefix-{i}", temperature=temperature, seed=4,
                              logprobs=True)
        assert out.route != "prfaas", out.summary
        # The slice says what the prefill took from its cache (DecodeEvent).
        assert out.summary["cached_tokens"] == (0 if i == 0 else 3 * BLOCK), out.summary
        assert out.tokens == reference(tuple(prompt), 6, temperature, 0, 1.0, 4), i
        assert_logprobs(prompt, out)
      # Routed by the slice's cache: 57 tokens > t = 16 would offload, but the
      # broker's probe finds 48 of them on the slice, so the tail (9) stays local
      # and the slice prefills it from its cache. A prompt of the same length
      # that nothing holds (the negative control) is offloaded.
      for rid, prompt, route, cached in (("auto-hit", shared + _tokens(9, 23), "pdp", 3 * BLOCK),
                                         ("auto-miss", _tokens(57, 24), "prfaas", 0)):
        out = client.generate(prompt_ids=prompt, max_new_tokens=6, request_id=rid, seed=4)
        assert out.route == route and out.summary["cached_tokens"] == cached, out.summary
        assert out.tokens == reference(tuple(prompt), 6, 0.0, 0, 1.0, 4), rid
    stats = _idle_slice_stats(cluster)
    assert stats["slice_processes"] == 2 and stats["prefix_cache_enabled"] == 1.0
    assert (stats["prefix_hits"], stats["prefix_misses"]) == (2.0, 1.0), stats
    assert stats["prefix_hit_tokens"] == 6 * BLOCK and stats.get("jobs_failed", 0) == 0
    # The slice's cache is for its own prefills: never shipped.
    with cluster.channel("decode") as ch, pytest.raises(grpc.RpcError) as e:
      serving_pb2_grpc.DecodeStub(ch).ExportPrefix(serving_pb2.ExportPrefixRequest(
          transfer_id="x", prompt_ids=shared + [1], max_tokens=3 * BLOCK, target="x:1"),
          timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only its own local prefills" in e.value.details()
  finally:
    cluster.stop()


def _idle_slice_stats(cluster) -> dict:
  """The slice's GetStats once no job runs (a job's counters land after its
  client has the last token)."""
  deadline = time.monotonic() + 60
  while True:
    with cluster.channel("decode") as ch:
      s = dict(serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                          timeout=30).gauges)
    if not (s.get("busy", 0) or s.get("queue", 0)) or time.monotonic() > deadline:
      return s
    time.sleep(0.2)
