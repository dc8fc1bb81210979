"""OpenAI's ``logprobs`` objects from the broker's ``TokenLogprob`` messages.

Completions (legacy shape), per choice or streamed chunk::

  {"tokens": ["a", ...], "token_logprobs": [-0.1, ...],
   "top_logprobs": [{"a": -0.1, "b": -2.3}, ...], "text_offset": [0, ...]}

Chat completions::

  {"content": [{"token": "a", "logprob": -0.1, "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}, ...]}],
   "refusal": null}

Token strings are the broker's ``token`` / ``top_tokens`` (the served
tokenizer's text of one token); without a tokenizer, ``token_id:<id>`` (as
vLLM's ``return_tokens_as_token_ids``). ``text_offset`` counts characters of
the generated text (no echo). ``-inf`` is sent as -9999.0 (as vLLM), since
JSON has no infinities.
"""

from __future__ import annotations

import math
from typing import Sequence

FLOOR = -9999.0


def _value(v: float) -> float:
  return FLOOR if math.isinf(v) or v < FLOOR else float(v)


def _text(token: str, token_id: int) -> str:
  return token if token else f"token_id:{token_id}"


class LogprobFormatter:
  """Formats the ``TokenLogprob`` messages of one response, chunk after chunk
  (``text_offset`` continues across the chunks of a completions stream)."""

  def __init__(self, chat: bool):
    self.chat = chat
    self.offset = 0

  def format(self, messages: Sequence) -> dict:
    """The ``logprobs`` object for ``messages`` (``serving_pb2.TokenLogprob``)."""
    if self.chat:
      return {"content": [self._chat_entry(m) for m in messages], "refusal": None}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for m in messages:
      token = _text(m.token, m.token_id)
      out["tokens"].append(token)
      out["token_logprobs"].append(_value(m.logprob))
      top: dict[str, float] = {}
      for i, (tid, v) in enumerate(zip(m.top_ids, m.top_logprobs)):
        name = _text(m.top_tokens[i] if i < len(m.top_tokens) else "", tid)
        top.setdefault(name, _value(v))  # largest first: a repeated string keeps its best
      out["top_logprobs"].append(top)
      out["text_offset"].append(self.offset)
      self.offset += len(token)
    return out

  @staticmethod
  def _chat_entry(m) -> dict:
    token = _text(m.token, m.token_id)
    top = []
    for i, (tid, v) in enumerate(zip(m.top_ids, m.top_logprobs)):
      name = _text(m.top_tokens[i] if i < len(m.top_tokens) else "", tid)
      top.append({"token": name, "logprob": _value(v), "bytes": list(name.encode("utf-8"))})
    return {"token": token, "logprob": _value(m.logprob), "bytes": list(token.encode("utf-8")),
            "top_logprobs": top}
