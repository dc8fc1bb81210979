"""Logprobs from the serving engines in-process vs the single-process reference.

Prefill engine (the first token) and the paged decode pool (later tokens):
every ``TokenLogprob`` must match ``log_softmax`` of the reference logits
within ``LOGPROB_ATOL``; a state damaged before insertion must fail the same
comparison (negative control). Requests without logprobs get none.
"""

from __future__ import annotations

import pytest

from paas_jax.models import api
from paas_jax.serving import common, logprob_check, logprobs
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import InvalidRequestError, RequestParams, validate_request
from paas_jax.state import sensitivity

common.enable_compilation_cache(common.default_compilation_cache())

ENGINE = EngineConfig(n_slots=2, max_ctx=128, page_size=16, prefill_buckets=(64,),
                      prefill_max_batch=2)
N_NEW = 5


@pytest.fixture(scope="module")
def model():
  return common.load_model("tiny_gdn_gqa", seed=0)[0]


@pytest.fixture(scope="module")
def engines(model):
  return PrefillEngine(model, ENGINE), DecodeEngine(model, ENGINE)


def _prompts(vocab: int) -> list[tuple[int, ...]]:
  return [tuple(p) for p in sensitivity.random_prompts(vocab, 2, 37, seed=3)]


def _serve(engines, prompts, params, damage=None):
  """Prefill both prompts in one batch, decode N_NEW tokens each in the pool;
  returns per prompt (tokens, [TokenLogprob or None per token])."""
  pe, de = engines
  outs = pe.prefill([PrefillInput(f"r{i}", p, params[i]) for i, p in enumerate(prompts)])
  slots, got = [], []
  for o, p, prm in zip(outs, prompts, params):
    slot = de.reserve(len(p) + N_NEW)
    state = o.state if damage is None else damage(o.state)
    de.insert(state, slot, o.first_token, prm)
    slots.append(slot)
    got.append(([o.first_token], [o.first_logprob]))
  for _ in range(N_NEW - 1):
    tokens = de.generate()
    lps = de.step_logprobs({s: prm.logprobs for s, prm in zip(slots, params)
                            if prm.logprobs >= 0})
    for s, (toks, lpl) in zip(slots, got):
      toks.append(int(tokens[s]))
      lpl.append(lps.get(s))
  for s in slots:
    de.free(s)
  return got


def test_engine_logprobs_match_reference(model, engines):
  prompts = _prompts(model.config.vocab_size)
  params = [RequestParams(seed=1, max_new_tokens=N_NEW, logprobs=5),
            RequestParams(api.SamplingParams(0.9, 0, 1.0), seed=7, max_new_tokens=N_NEW,
                          logprobs=0)]
  got = _serve(engines, prompts, params)
  for (tokens, lps), prompt, prm in zip(got, prompts, params):
    assert [lp.token_id for lp in lps] == tokens
    assert all(len(lp.top_ids) == prm.logprobs for lp in lps)
    ref = logprob_check.reference_logprobs(model, prompt, tokens)
    cmp = logprob_check.compare(lps, ref)
    assert cmp.ok, cmp
  greedy_tokens = got[0][0]
  assert greedy_tokens == list(api.generate(model, list(prompts[0]), N_NEW).tokens)
  # Greedy: the sampled token is the top-1 alternative.
  assert all(lp.top_ids[0] == lp.token_id for lp in got[0][1])


def test_no_logprobs_unless_asked(model, engines):
  prompts = _prompts(model.config.vocab_size)
  params = [RequestParams(seed=1, max_new_tokens=N_NEW)] * 2
  got = _serve(engines, prompts, params)
  assert all(lp is None for _, lps in got for lp in lps)


def test_damaged_state_fails_the_logprob_comparison(model, engines):
  """Negative control: the decode pool holds a damaged state (recurrent state
  zeroed, last KV block dropped: ``sensitivity.damage``); its steps' logprobs
  no longer match the reference, while the first token (prefill side) does."""
  prompts = _prompts(model.config.vocab_size)
  params = [RequestParams(seed=1, max_new_tokens=N_NEW, logprobs=5)] * 2
  kinds = model.config.layer_kinds
  got = _serve(engines, prompts, params,
               damage=lambda s: sensitivity.damage(s, kinds))
  for (tokens, lps), prompt in zip(got, prompts):
    ref = logprob_check.reference_logprobs(model, prompt, tokens)
    assert logprob_check.compare(lps, ref, steps=[0]).ok
    cmp = logprob_check.compare(lps, ref, steps=range(1, N_NEW))
    assert not cmp.ok and cmp.max_error > 10 * logprob_check.LOGPROB_ATOL, cmp


def test_logprob_request_validation(model):
  assert logprobs.requested_top(False, 0) == logprobs.LOGPROBS_OFF
  assert logprobs.requested_top(True, 0) == 0
  assert logprobs.requested_top(True, 20) == 20
  for on, top, why in ((True, 21, "top_logprobs"), (True, -1, "top_logprobs"),
                       (False, 3, "needs logprobs")):
    with pytest.raises(logprobs.LogprobsError, match=why):
      logprobs.requested_top(on, top)
  with pytest.raises(InvalidRequestError, match="top_logprobs"):
    validate_request(model.config, [1, 2], RequestParams(logprobs=21))
