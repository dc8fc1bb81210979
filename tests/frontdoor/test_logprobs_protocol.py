"""OpenAI logprobs fields: parsing (both endpoints) and the response shapes."""

from __future__ import annotations

import json

import pytest

from paas_jax.frontdoor import protocol
from paas_jax.frontdoor.logprob_format import FLOOR, LogprobFormatter
from paas_jax.frontdoor.protocol import APIError
from paas_jax.proto import serving_pb2

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def test_completion_logprobs_field():
  parse = lambda **kw: protocol.parse_completion({"model": MODEL, "prompt": "a", **kw}, MODEL)
  assert parse().logprobs == -1
  assert parse(logprobs=None).logprobs == -1
  assert parse(logprobs=0).logprobs == 0
  assert parse(logprobs=20).logprobs == 20
  for bad, param in (({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                     ({"logprobs": True}, "logprobs"), ({"logprobs": 1.5}, "logprobs"),
                     ({"top_logprobs": 3}, "top_logprobs")):
    with pytest.raises(APIError) as e:
      parse(**bad)
    assert e.value.status == 400 and e.value.param == param


def test_chat_logprobs_fields():
  parse = lambda **kw: protocol.parse_chat({**CHAT, **kw}, MODEL)[0]["logprobs"]
  assert parse() == -1 and parse(logprobs=False) == -1
  assert parse(logprobs=True) == 0
  assert parse(logprobs=True, top_logprobs=4) == 4
  for bad, param in (({"logprobs": 3}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                     ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                     ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
    with pytest.raises(APIError) as e:
      parse(**bad)
    assert e.value.status == 400 and e.value.param == param


def _msgs():
  return [serving_pb2.TokenLogprob(token_id=104, logprob=-0.25, top_ids=[104, 105],
                                   top_logprobs=[-0.25, -1.5], token="h",
                                   top_tokens=["h", "i"]),
          serving_pb2.TokenLogprob(token_id=300, logprob=float("-inf"), top_ids=[7],
                                   top_logprobs=[-0.125])]


def test_completion_shape_and_offsets():
  f = LogprobFormatter(chat=False)
  first = f.format(_msgs()[:1])
  second = f.format(_msgs()[1:])
  assert first == {"tokens": ["h"], "token_logprobs": [-0.25],
                   "top_logprobs": [{"h": -0.25, "i": -1.5}], "text_offset": [0]}
  # Without token text: token_id:<id>; -inf as FLOOR; offsets continue across chunks.
  assert second == {"tokens": ["token_id:300"], "token_logprobs": [FLOOR],
                    "top_logprobs": [{"token_id:7": -0.125}], "text_offset": [1]}
  json.dumps(second, allow_nan=False)


def test_chat_shape():
  out = LogprobFormatter(chat=True).format(_msgs()[:1])
  assert out == {"refusal": None, "content": [{
      "token": "h", "logprob": -0.25, "bytes": [104],
      "top_logprobs": [{"token": "h", "logprob": -0.25, "bytes": [104]},
                       {"token": "i", "logprob": -1.5, "bytes": [105]}]}]}
