"""OpenAI logprobs through the real deployment (gateway over TLS, broker, both
regions) with the official ``openai`` client, in OpenAI's response shapes,
streamed and not; values compared with the single-process reference logits
(``logprob_check``: log_softmax of one full prefill) within ``LOGPROB_ATOL``."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from paas_jax.frontdoor.tokenization import ChatTemplate
from paas_jax.serving import logprob_check

from tests.frontdoor.conftest import CONFIG, LONG, SHORT

MODEL = CONFIG
ATOL = logprob_check.LOGPROB_ATOL


def _prompt(length: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(3100 + salt).integers(0, 256, length)]


def _check_values(ref_model, prompt, ids, sampled, tops, k):
  """``sampled[j]``: the served log p of token ``ids[j]``; ``tops[j]``: the
  served top-``k`` values; both against reference row j. The completions
  shape is a dict keyed by token text, where byte tokens >= 128 (all U+FFFD
  alone) collapse to their best value: so each served value must be one of the
  reference's top-k, and the best must be the reference's best."""
  ref = logprob_check.reference_logprobs(ref_model, prompt, ids)
  for j, tid in enumerate(ids):
    assert abs(sampled[j] - ref[j, tid]) <= ATOL, (j, sampled[j], ref[j, tid])
    want = np.sort(ref[j])[::-1][:k]
    assert abs(max(tops[j]) - want[0]) <= ATOL, (j, tops[j], want)
    assert all(np.min(np.abs(want - v)) <= ATOL for v in tops[j]), (j, tops[j], want)


@pytest.mark.parametrize("length,route", [(SHORT, "pdp"), (LONG, "prfaas")])
def test_completion_logprobs(oai, ref_model, reference, length, route):
  prompt = _prompt(length, length)
  out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0,
                               logprobs=3)
  choice = out.choices[0]
  assert out.model_extra["paas_jax"]["route"] == route
  ids = list(choice.model_extra["token_ids"])
  assert ids == list(reference(tuple(prompt), 5))
  lp = choice.logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
  # The byte tokenizer's text of each token; offsets into the generated text.
  assert lp.tokens == [bytes([t]).decode("utf-8", "replace") for t in ids]
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)
  _check_values(ref_model, prompt, ids, lp.token_logprobs,
                [list(d.values()) for d in lp.top_logprobs], 3)
  # Greedy: the sampled token is the most likely one.
  assert all(abs(v - max(d.values())) <= 1e-6 for v, d in zip(lp.token_logprobs,
                                                              lp.top_logprobs))


def test_completion_stream_logprobs_and_none_unless_asked(oai, ref_model):
  prompt = _prompt(LONG, 1)
  ids, sampled, tops = [], [], []
  for chunk in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      temperature=0.0, logprobs=2, stream=True):
    for c in chunk.choices:
      got = c.model_extra["token_ids"]
      ids.extend(got)
      if got:
        assert len(c.logprobs.tokens) == len(got)
        sampled.extend(c.logprobs.token_logprobs)
        tops.extend(list(d.values()) for d in c.logprobs.top_logprobs)
      else:
        assert c.logprobs is None
  assert len(ids) == len(sampled) == 6
  _check_values(ref_model, prompt, ids, sampled, tops, 2)
  plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
  assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(oai, ref_model, stream):
  messages = [{"role": "user", "content": "Which region prefilled me, and why? " * 3}]
  prompt = list(ChatTemplate().render(messages).encode())
  kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0.0,
                logprobs=True, top_logprobs=2)
  if stream:
    ids, content = [], []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
      for c in chunk.choices:
        ids.extend(c.model_extra["token_ids"])
        if c.logprobs is not None:
          content.extend(c.logprobs.content)
  else:
    out = oai.chat.completions.create(**kwargs)
    ids, content = list(out.choices[0].model_extra["token_ids"]), out.choices[0].logprobs.content
    assert out.choices[0].logprobs.refusal is None
  assert len(content) == len(ids) == 5
  for entry, tid in zip(content, ids):
    assert entry.token == bytes([tid]).decode("utf-8", "replace")
    assert entry.bytes == list(entry.token.encode())
    assert len(entry.top_logprobs) == 2
    assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert abs(entry.top_logprobs[0].logprob - entry.logprob) <= 1e-6  # greedy
  tops = [[t.logprob for t in e.top_logprobs] for e in content]
  _check_values(ref_model, prompt, ids, [e.logprob for e in content], tops, 2)
  # The chat shape is a list: no collapse, exactly the reference's top 2.
  ref = logprob_check.reference_logprobs(ref_model, prompt, ids)
  assert np.allclose(tops, np.sort(ref, axis=-1)[:, ::-1][:, :2], atol=ATOL)


def test_bad_logprobs_requests_are_400(oai):
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                max_tokens=2, top_logprobs=2)
  with pytest.raises(openai.BadRequestError, match="top_logprobs"):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                max_tokens=2, logprobs=True, top_logprobs=21)
  with pytest.raises(openai.BadRequestError, match="logprobs"):
    oai.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2, logprobs=21)
