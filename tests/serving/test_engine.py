"""The serving engines in-process: paged decode pool vs single-process ``generate``."""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.models import api
from paas_jax.serving import common
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.decode_scheduler import DecodeJob, DecodeScheduler, QueueFullError
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.slot_pool import PageAllocator, PoolExhaustedError
from paas_jax.serving.validation import InvalidRequestError, RequestParams, validate_request
from tests.serving.engine_rig import decode_to_completion

common.enable_compilation_cache(common.default_compilation_cache())

ENGINE = EngineConfig(n_slots=3, max_ctx=256, page_size=16, prefill_buckets=(64,),
                      prefill_max_batch=2)


@pytest.fixture(scope="module", params=["tiny_gdn_gqa", "tiny_kda_mla"])
def model(request):
  return common.load_model(request.param, seed=0)[0]


def _requests(vocab: int) -> list[PrefillInput]:
  """Seven requests over two prompt lengths (one spans two prefill chunks)."""
  rng = np.random.default_rng(5)
  out = []
  for i in range(7):
    length = 37 if i % 2 else 90
    sampling = api.SamplingParams(*[(0.0, 0, 1.0), (0.8, 0, 0.9), (1.0, 30, 1.0)][i % 3])
    out.append(PrefillInput(f"r{i}", tuple(int(t) for t in rng.integers(0, vocab, length)),
                            RequestParams(sampling, seed=100 + i, max_new_tokens=5 + 3 * i)))
  return out


def _run_engine(model, reqs: list[PrefillInput]) -> dict[str, list[int]]:
  """Prefill in batches of two, continuous batching over three slots."""
  pe, de = PrefillEngine(model, ENGINE), DecodeEngine(model, ENGINE)
  outs = []
  for i in range(0, len(reqs), 2):
    outs += pe.prefill(reqs[i:i + 2])
  result = decode_to_completion(de, list(zip(reqs, outs)))
  assert de.free_pages == de.num_pages and de.free_slots == ENGINE.n_slots
  return result


def test_paged_pool_matches_generate(model):
  reqs = _requests(model.config.vocab_size)
  got = _run_engine(model, reqs)
  for r in reqs:
    ref = api.generate(model, r.prompt, r.params.max_new_tokens, sampling=r.params.sampling,
                       seed=r.params.seed).tokens
    assert got[r.request_id] == ref, r.request_id


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_swa_gqa", "tiny_mamba2_gqa"])
def test_paged_pool_matches_generate_other_layer_kinds(name):
  model = common.load_model(name, seed=0)[0]
  reqs = _requests(model.config.vocab_size)
  got = _run_engine(model, reqs)
  for r in reqs:
    ref = api.generate(model, r.prompt, r.params.max_new_tokens, sampling=r.params.sampling,
                       seed=r.params.seed).tokens
    assert got[r.request_id] == ref, r.request_id


def test_page_allocator_and_reservations(model):
  alloc = PageAllocator(4)
  a = alloc.alloc(3)
  with pytest.raises(PoolExhaustedError):
    alloc.alloc(2)
  alloc.release(a)
  assert alloc.free_pages == 4

  de = DecodeEngine(model, EngineConfig(n_slots=2, max_ctx=64, page_size=16, num_pages=5))
  assert de.max_ctx == 64 and de.num_pages == 5
  s0 = de.reserve(64)  # 4 pages
  assert not de.can_admit(32)  # 1 page left
  with pytest.raises(PoolExhaustedError):
    de.reserve(32)
  s1 = de.reserve(10)
  with pytest.raises(PoolExhaustedError):
    de.reserve(1)  # no slot left
  with pytest.raises(InvalidRequestError):
    de.reserve(65)  # can never fit
  de.free(s0)
  de.free(s1)
  assert de.free_pages == 5 and de.free_slots == 2


def test_scheduler_admission_control(model):
  de = DecodeEngine(model, EngineConfig(n_slots=1, max_ctx=64))
  sched = DecodeScheduler(de, max_queue=1)
  try:
    params = RequestParams(max_new_tokens=4)
    sched.submit(DecodeJob("a", params, 10, remote=True))
    sched.submit(DecodeJob("b", params, 10, remote=True))
    with pytest.raises(QueueFullError, match="decode pool full"):
      sched.submit(DecodeJob("c", params, 10, remote=True))
    with pytest.raises(InvalidRequestError):
      sched.submit(DecodeJob("d", RequestParams(max_new_tokens=60), 10, remote=True))
    sched.cancel("a")
    sched.submit(DecodeJob("c", params, 10, remote=True))
  finally:
    sched.stop()


@pytest.mark.parametrize("prompt,params,needle", [
    ([], RequestParams(), "empty"),
    ([1, 256], RequestParams(), "vocabulary"),
    ([1], RequestParams(max_new_tokens=0), "max_new_tokens"),
    ([1] * 1024, RequestParams(), "context"),
    ([1] * 1000, RequestParams(max_new_tokens=100), "exceeds"),
    ([1], RequestParams(seed=-1), "seed"),
    ([1], RequestParams(stop_tokens=(300,)), "stop token"),
])
def test_validate_request(prompt, params, needle):
  from paas_jax.models import load_config
  with pytest.raises(InvalidRequestError, match=needle):
    validate_request(load_config("tiny_gdn_gqa"), prompt, params)


def test_prefix_gauges_count_reuse_once_per_prompt():
  """Region A style (transfer-owned tail): the gauges report what reuse saved.

  The shared part of a transfer-owned prompt is cached by a first lookup and
  reused by a second one inside the same prefill; that inner hit must not
  count. Only the second prompt, which shares 64 cached tokens, is a hit.
  """
  model = common.load_model("tiny_gdn_gqa", seed=0)[0]
  engine = PrefillEngine(model, EngineConfig(n_slots=2, max_ctx=256, prefill_buckets=(64,),
                                             prefill_max_batch=1, prefix_block=32))
  rng = np.random.default_rng(0)
  shared = tuple(int(t) for t in rng.integers(0, model.config.vocab_size, 64))
  params = RequestParams(api.SamplingParams(0.0, 0, 1.0), seed=0, max_new_tokens=2)
  first = PrefillInput("a", shared + (1, 2, 3, 4, 5), params, cache_owner="a")
  second = PrefillInput("b", shared + (6, 7, 8), params, cache_owner="b")
  out_a, = engine.prefill([first])
  out_b, = engine.prefill([second])
  assert (out_a.cached_tokens, out_b.cached_tokens) == (0, 64)
  g = common.prefix_cache_gauges(engine)
  assert (g["prefix_hits"], g["prefix_misses"], g["prefix_hit_tokens"]) == (1.0, 1.0, 64.0)
  # The cache's own lookups saw the inner hit of the first prompt as well.
  assert g["prefix_lookup_hit_tokens"] > g["prefix_hit_tokens"]


def test_scheduler_event_kinds_are_typed():
  from paas_jax.serving.decode_scheduler import Event, EventKind
  assert Event("tokens", tokens=(1,)).kind is EventKind.TOKENS
  assert {k.value for k in EventKind} == {"slot", "tokens", "finished", "error"}
  with pytest.raises(ValueError, match="not a valid EventKind"):
    Event("token")  # a misspelt kind fails where it is made, not as a silent no-match
