"""The pure parts of the front door: request parsing, errors, stop strings,
chat templates."""

from __future__ import annotations

import pytest

from paas_jax.frontdoor import protocol
from paas_jax.frontdoor.protocol import APIError
from paas_jax.frontdoor.tokenization import ChatTemplate, StopStrings, TemplateError

MODEL = "m"


def test_parse_completion_fields():
  req = protocol.parse_completion({"model": MODEL, "prompt": [[5, 6, 7]], "max_tokens": 3,
                                   "temperature": 0, "top_p": 0.5, "top_k": 4, "seed": 9,
                                   "stop": "x", "stop_token_ids": [2], "ignore_eos": True,
                                   "route": "remote"}, MODEL)
  assert req.prompt_ids == (5, 6, 7) and req.prompt_text is None
  assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (3, 0, .5, 4, 9)
  assert req.stop == ("x",) and req.stop_token_ids == (2,) and req.ignore_eos
  assert req.route == "remote" and not req.chat
  # OpenAI's defaults: 16 tokens, temperature 1.
  d = protocol.parse_completion({"model": MODEL, "prompt": "hi"}, MODEL)
  assert (d.max_tokens, d.temperature, d.prompt_text) == (16, 1.0, "hi")


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, True]}, 400, "prompt"),
    ({"model": "other", "prompt": "a"}, 404, "model"),
    ({"prompt": "a"}, 400, "model"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": -0.1}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, 400, "stop"),
    ({"model": MODEL, "prompt": "a", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "a", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "prompt": "a", "route": "moon"}, 400, "route"),
    ({"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
])
def test_parse_completion_refuses(body, status, param):
  with pytest.raises(APIError) as e:
    protocol.parse_completion(body, MODEL)
  assert e.value.status == status and e.value.param == param
  err = e.value.body()["error"]
  assert err["message"] and err["type"]


def test_parse_json():
  assert protocol.parse_json(b'{"a": 1}') == {"a": 1}
  with pytest.raises(APIError):
    protocol.parse_json(b"{nope")
  with pytest.raises(APIError):
    protocol.parse_json(b"\xff\xfe")


def test_chat_messages():
  fields, msgs = protocol.parse_chat({"model": MODEL, "messages": [
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                   "text": "b"}]}],
      "max_completion_tokens": 4}, MODEL)
  assert msgs == [{"role": "user", "content": "ab"}] and fields["max_tokens"] == 4
  for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}],
              [{"role": "user", "content": ""}]):
    with pytest.raises(APIError):
      protocol.parse_chat({"model": MODEL, "messages": bad}, MODEL)


@pytest.mark.parametrize("code,status", [("INVALID_ARGUMENT", 400), ("UNAUTHENTICATED", 401),
                                         ("PERMISSION_DENIED", 403),
                                         ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503),
                                         ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 500)])
def test_grpc_status_to_http(code, status):
  e = APIError.from_grpc(code, "why")
  assert e.status == status and "why" in e.message and e.body()["error"]["code"]


def test_stop_strings_hold_back_and_cut():
  s = StopStrings(("END",))
  assert s.feed("abcE") == ("abc", False)  # "E" may start "END": held back
  assert s.feed("N") == ("", False)
  assert s.feed("Dxyz") == ("", True)
  assert s.feed("more") == ("", True)
  s = StopStrings(("END",))
  assert s.feed("abcE") == ("abc", False)
  assert s.feed("Nx") == ("ENx", False)  # not a stop after all: released
  assert s.flush() == ""
  s = StopStrings(("zz",))
  assert s.feed("az") == ("a", False)
  assert s.flush() == "z"
  assert StopStrings(()).feed("END") == ("END", False)


def test_chat_template_plain_and_jinja():
  msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
  assert ChatTemplate().render(msgs) == "system: S\nuser: U\nassistant:"
  qwen_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  t = ChatTemplate(qwen_like)
  assert t.name == "checkpoint"
  assert t.render(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                            "<|im_start|>assistant\n")
  strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first')"
                        " }}{% endif %}{{ bos_token }}{{ messages[0].content }}",
                        {"bos_token": "<s>"})
  assert strict.render([{"role": "user", "content": "x"}]) == "<s>x"
  with pytest.raises(TemplateError, match="user first"):
    strict.render(msgs)
  # The sandbox refuses attribute access to Python internals.
  with pytest.raises(TemplateError):
    ChatTemplate("{{ messages.__class__.__mro__ }}").render(msgs)
