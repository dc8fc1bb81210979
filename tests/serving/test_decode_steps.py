"""Several decode steps per device call (``generate_steps``, ``decode_steps_per_sync``):
the tokens equal one step per call and single-process ``generate``."""

from __future__ import annotations

import concurrent.futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.models import api, sampler
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common, logprob_check
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.decode_scheduler import DecodeJob, DecodeScheduler
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import EngineError, RequestParams

common.enable_compilation_cache(common.default_compilation_cache())

ENGINE = EngineConfig(n_slots=3, max_ctx=128, page_size=16, prefill_buckets=(64,),
                      prefill_max_batch=1)
SAMPLINGS = [(0.0, 0, 1.0), (0.8, 0, 0.9), (1.0, 30, 1.0)]


@pytest.fixture(scope="module")
def model():
  return common.load_model("tiny_gdn_gqa", seed=0)[0]


def _inputs(vocab: int, n: int, max_new: int) -> list[PrefillInput]:
  rng = np.random.default_rng(11)
  return [PrefillInput(f"r{i}", tuple(int(t) for t in rng.integers(0, vocab, 20 + 7 * i)),
                       RequestParams(api.SamplingParams(*SAMPLINGS[i % 3]), seed=40 + i,
                                     max_new_tokens=max_new)) for i in range(n)]


def _reference(model, x: PrefillInput) -> list[int]:
  return api.generate(model, x.prompt, x.params.max_new_tokens, sampling=x.params.sampling,
                      seed=x.params.seed, stop_tokens=x.params.stop_tokens).tokens


def _engine_windows(model, inputs, windows: list[int]) -> dict[str, list[int]]:
  """Every input in its own slot, then decode windows of the given sizes."""
  pe, de = PrefillEngine(model, ENGINE), DecodeEngine(model, ENGINE)
  got = {}
  for x in inputs:
    out = pe.prefill([x])[0]
    slot = de.reserve(len(x.prompt) + x.params.max_new_tokens)
    de.insert(out.state, slot, out.first_token, x.params)
    got[slot] = (x.request_id, [out.first_token])
  for k in windows:
    rows = de.generate_steps(k)
    assert rows.shape == (k, ENGINE.n_slots)
    for row in rows:
      for slot, (_, toks) in got.items():
        toks.append(int(row[slot]))
  return dict(got.values())


def test_generate_steps_equals_single_steps_and_generate(model):
  inputs = _inputs(model.config.vocab_size, 3, 16)
  windowed = _engine_windows(model, inputs, [8, 4, 2, 1])
  single = _engine_windows(model, inputs, [1] * 15)
  for x in inputs:
    ref = _reference(model, x)
    assert windowed[x.request_id] == ref == single[x.request_id], x.request_id
  # Negative control: a window started one position late (the pool's lengths
  # shifted) samples other tokens, so the comparison above can fail.
  pe, de = PrefillEngine(model, ENGINE), DecodeEngine(model, ENGINE)
  x = inputs[1]  # sampled: keyed by (seed, position)
  out = pe.prefill([x])[0]
  slot = de.reserve(len(x.prompt) + x.params.max_new_tokens)
  de.insert(out.state, slot, out.first_token, x.params)
  de.pool = de.pool.replace(lengths=de.pool.lengths + 1)
  shifted = [out.first_token] + [int(t) for t in de.generate_steps(8)[:, slot]]
  assert shifted != _reference(model, x)[:9]
  with pytest.raises(EngineError, match="steps >= 1"):
    de.generate_steps(0)


def _run_scheduler(model, inputs, steps_per_sync: int):
  pe = PrefillEngine(model, ENGINE)
  de = DecodeEngine(model, EngineConfig(**{**ENGINE.__dict__,
                                           "decode_steps_per_sync": steps_per_sync}))
  sched = DecodeScheduler(de)
  jobs = []
  try:
    for x in inputs:
      job = DecodeJob(x.request_id, x.params, len(x.prompt), remote=True)
      sched.submit(job)
      out = pe.prefill([x])[0]
      sched.provide_state(x.request_id, out.state)
      sched.provide_first_token(x.request_id, out.first_token)
      jobs.append(job)
    got = {}
    for job in jobs:
      toks, reason = [], None
      while reason is None:
        ev = job.events.get(timeout=120)
        assert ev.kind != "error", ev.reason
        toks += ev.tokens
        reason = ev.reason if ev.kind == "finished" else None
      got[job.request_id] = (toks, reason)
    return got, dict(sched.counters)
  finally:
    sched.stop()


def test_scheduler_windows_token_exact_with_stops_and_queueing(model):
  """Five requests over three slots (two wait for a slot), different lengths, and
  stop tokens that end requests in the middle of a window."""
  vocab = model.config.vocab_size
  inputs = _inputs(vocab, 5, 13)
  # Each request's stop token: its reference's 6th token (ends mid-window).
  stopped = []
  for i, x in enumerate(inputs):
    params = x.params
    if i % 2 == 0:
      ref = _reference(model, x)
      params = RequestParams(params.sampling, seed=params.seed,
                             max_new_tokens=params.max_new_tokens, stop_tokens=(ref[5],))
    else:
      params = RequestParams(params.sampling, seed=params.seed, max_new_tokens=5 + 2 * i)
    stopped.append(PrefillInput(x.request_id, x.prompt, params))
  got, counters = _run_scheduler(model, stopped, steps_per_sync=8)
  for x in stopped:
    ref = _reference(model, x)
    toks, reason = got[x.request_id]
    assert toks == ref, x.request_id
    assert reason == ("stop_token" if x.params.stop_tokens else "max_tokens")
  # Several steps really ran per device call.
  assert counters["device_calls"] < counters["steps"]
  # Negative control: with windows the pool samples past a stop token (the
  # scheduler drops those); tokens kept past the stop differ from the reference.
  x = stopped[0]
  raw = _engine_windows(model, [PrefillInput(x.request_id, x.prompt, RequestParams(
      x.params.sampling, seed=x.params.seed, max_new_tokens=13))], [8, 4])[x.request_id]
  assert raw != _reference(model, x) and raw[:len(_reference(model, x))] == _reference(
      model, x)


def test_greedy_fast_path_and_mixed_batches_sample_from_the_kept_sets():
  """``sample_tokens`` takes only the argmax when every row is greedy; in a mixed
  batch its greedy rows take the argmax and its sampled rows draw from the
  sorting sampler's kept sets (the baseline it replaced)."""
  n, vocab = 6, 1000
  logits = jax.random.normal(jax.random.key(1), (n, vocab)) * 3
  keys = api.sampling_keys(np.arange(n, dtype=np.uint32), jnp.arange(n, dtype=jnp.int32))
  top_k, top_p = jnp.array([0, 5, 0, 50, 0, 0], jnp.int32), jnp.array([1, 1, .9, 1, .5, 1.])
  greedy = jnp.zeros((n,))
  mixed = jnp.array([0.0, 0.8, 0.0, 1.2, 0.7, 0.0])
  argmax = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(np.asarray(api.sample_tokens(logits, keys, greedy, top_k, top_p)),
                                argmax)
  np.testing.assert_array_equal(
      np.asarray(api.sample_tokens_sorted(logits, keys, greedy, top_k, top_p)), argmax)
  _, ids, keep = sampler.sorted_kept_mask(logits, mixed, top_k, top_p)
  for draw in range(8):
    got = np.asarray(api.sample_tokens(logits, jax.vmap(jax.random.fold_in, (0, None))(keys, draw),
                                       mixed, top_k, top_p))
    for r in range(n):
      if mixed[r] <= 0:
        assert got[r] == argmax[r]
      else:
        assert got[r] in set(np.asarray(ids[r])[np.asarray(keep[r])].tolist())
  # Negative control: the sampled rows of the mixed batch are not all the argmax.
  got = np.asarray(api.sample_tokens(logits, keys, mixed, top_k, top_p))
  assert (got != argmax).any()


@pytest.mark.slow
def test_real_servers_with_decode_windows_are_token_exact(tmp_path, model):
  """Decode servers started with --decode_steps_per_sync=4 behind the broker (remote
  and local prefill, concurrent requests, greedy and sampled, a stop token, one
  request with logprobs): tokens (and logprobs) equal single-process generation,
  and the decode server ran several steps per device call."""
  spec = ClusterSpec(config="tiny_gdn_gqa", seed=0, n_slots=3, max_ctx=256,
                     prefill_buckets=(64,), prefill_max_batch=2, threshold=40,
                     decode_args=("--decode_steps_per_sync=4",),
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  rng = np.random.default_rng(21)
  cases = []
  for i in range(6):
    prompt = tuple(int(t) for t in rng.integers(0, 256, 60 if i % 2 else 25))
    temperature, top_p = SAMPLINGS[i % 3][0], SAMPLINGS[i % 3][2]
    stops = ()
    if i == 2:
      ref = api.generate(model, prompt, 20, sampling=api.SamplingParams(temperature, 0, top_p),
                         seed=i).tokens
      stops = (ref[6],)
    cases.append(dict(prompt_ids=prompt, max_new_tokens=20 - i, temperature=temperature,
                      top_p=top_p, seed=i, stop_tokens=stops, logprobs=i == 4,
                      route="remote" if i % 2 else "local"))
  with LocalCluster(spec, tmp_path) as cluster, BrokerClient(cluster.broker_address,
                                                             timeout_s=300) as client:
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
      outs = list(pool.map(lambda c: client.generate(**c), cases))
    with grpc.insecure_channel(cluster.decode_address) as ch:
      stats = dict(serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                            timeout=10).gauges)
  for c, out in zip(cases, outs):
    want = api.generate(model, c["prompt_ids"], c["max_new_tokens"],
                        sampling=api.SamplingParams(c["temperature"], 0, c["top_p"]),
                        seed=c["seed"], stop_tokens=c["stop_tokens"]).tokens
    assert out.tokens == want, c
    if c["logprobs"]:
      cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
          model, list(c["prompt_ids"]), out.tokens))
      assert cmp.ok and cmp.steps == len(out.tokens), cmp
  assert 0 < stats["device_calls"] < stats["steps"], stats
