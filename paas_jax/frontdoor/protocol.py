"""The OpenAI wire format: request parsing, response bodies, error bodies.

Requests are parsed into a frozen ``GenerationRequest`` (pure functions of the
decoded JSON body, no I/O); every problem raises ``APIError`` with the HTTP
status and OpenAI's error JSON::

  {"error": {"message": "...", "type": "invalid_request_error",
             "param": "max_tokens", "code": null}}

Supported request fields (the rest of OpenAI's fields are refused with 400
when set to something this server cannot honour, ignored when harmless):

  completions       model, prompt (text | token ids | a one-element list of
                    either), max_tokens, temperature, top_p, top_k, seed, stop
                    (string | list of <= 4 strings), n=1, stream,
                    stream_options.include_usage, user, logprobs (0..20: the
                    sampled token's log-probability and that many top
                    alternatives per token);
                    extensions (as vLLM): stop_token_ids, ignore_eos, route
                    ("auto" | "local" | "remote").
  chat/completions  the same with messages instead of prompt,
                    max_completion_tokens as an alias of max_tokens, and
                    logprobs (bool) + top_logprobs (0..20) instead of logprobs.

Logprobs come in OpenAI's shapes (``logprob_format``), streamed or not: the
model's log_softmax before temperature/top-k/top-p (``serving/logprobs.py``).

Response extension: ``paas_jax`` on the completion object (and on the final
streamed chunk) holds the route the request took, where it was prefilled and
the bytes it put on the inter-region link; the same is in the
``x-paas-route``, ``x-paas-prefill-server`` and ``x-paas-link-bytes`` headers.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_TOP_LOGPROBS = 20  # = paas_jax.serving.logprobs.MAX_TOP_LOGPROBS
ROUTES = ("auto", "local", "remote")
# Fields OpenAI defines that change the answer and that this server does not
# implement: refused instead of silently ignored.
_UNSUPPORTED_IF_SET = ("echo", "best_of", "suffix", "tools",
                       "tool_choice", "functions", "function_call", "response_format",
                       "logit_bias", "presence_penalty", "frequency_penalty")
# gRPC status name -> (HTTP status, OpenAI error type).
GRPC_TO_HTTP = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
    "CANCELLED": (499, "cancelled"),
}


class APIError(Exception):
  """An HTTP error with OpenAI's error body."""

  def __init__(self, status: int, message: str, *, err_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.err_type = err_type
    self.param = param
    self.code = code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                      "code": self.code}}

  @classmethod
  def from_grpc(cls, code_name: str, details: str) -> "APIError":
    status, err_type = GRPC_TO_HTTP.get(code_name, (500, "internal_error"))
    return cls(status, f"{code_name}: {details}" if details else code_name,
               err_type=err_type, code=code_name.lower())


def bad(message: str, param: str | None = None) -> APIError:
  return APIError(400, message, param=param)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """One validated request of either endpoint.

  Exactly one of ``prompt_text`` / ``prompt_ids`` is set. ``chat`` marks a
  rendered chat template (special tokens already in the text).
  """

  model: str
  prompt_text: str | None
  prompt_ids: tuple[int, ...] | None
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: int
  stop: tuple[str, ...]
  stop_token_ids: tuple[int, ...]
  ignore_eos: bool
  stream: bool
  include_usage: bool
  route: str
  chat: bool
  # Top alternatives per token (0..MAX_TOP_LOGPROBS) or -1: no logprobs.
  logprobs: int = -1


# -- field readers (each names the field in its error) ---------------------------------

def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
  v = body.get(name)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
    raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise bad(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
  return int(v) if integer else float(v)


def _token_ids(value, name: str) -> tuple[int, ...]:
  if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
    raise bad(f"'{name}' must be a string or a list of integer token ids", name)
  if any(t < 0 for t in value):
    raise bad(f"'{name}' token ids must be >= 0", name)
  return tuple(value)


def _stop(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
    raise bad("'stop' must be a string or a list of strings", "stop")
  if len(stops) > MAX_STOP_STRINGS:
    raise bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings", "stop")
  if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
    raise bad(f"each 'stop' string must be 1-{MAX_STOP_CHARS} characters", "stop")
  return tuple(stops)


def _common(body: dict, served_model: str, chat: bool = False) -> dict:
  if not isinstance(body, dict):
    raise bad("the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise bad("'model' is required", "model")
  if model != served_model:
    raise APIError(404, f"The model '{model}' does not exist; this server serves "
                   f"'{served_model}'", err_type="not_found_error", param="model",
                   code="model_not_found")
  for name in _UNSUPPORTED_IF_SET:
    if body.get(name) not in (None, False, 0, [], {}):
      raise bad(f"'{name}' is not supported by this server", name)
  if _number(body, "n", 1, integer=True) != 1:
    raise bad("only n=1 is supported", "n")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  if max_tokens is None:
    max_tokens = 16
  elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
    raise bad(f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise bad("'stream' must be a boolean", "stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise bad("'stream_options' must be an object", "stream_options")
  route = body.get("route", "auto")
  if route not in ROUTES:
    raise bad(f"'route' must be one of {list(ROUTES)}", "route")
  stop_ids = body.get("stop_token_ids") or []
  if not isinstance(stop_ids, list):
    raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
  ignore_eos = body.get("ignore_eos", False)
  if not isinstance(ignore_eos, bool):
    raise bad("'ignore_eos' must be a boolean", "ignore_eos")
  seed = _number(body, "seed", 0, integer=True)
  return dict(
      logprobs=_logprobs(body, chat),
      model=model, max_tokens=max_tokens,
      # OpenAI's default temperature is 1 (sampling); 0 = greedy.
      temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
      top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
      top_k=max(0, _number(body, "top_k", 0, -1, None, integer=True)),
      seed=seed & 0x7FFFFFFFFFFFFFFF, stop=_stop(body),
      stop_token_ids=_token_ids(stop_ids, "stop_token_ids"), ignore_eos=ignore_eos,
      stream=stream, include_usage=bool(options.get("include_usage", False)), route=route)


def _logprobs(body: dict, chat: bool) -> int:
  """The top count asked for (-1: none). Completions: ``logprobs`` an integer
  0..20; chat: ``logprobs`` a boolean, ``top_logprobs`` 0..20 (which needs
  ``logprobs: true``, as OpenAI)."""
  if not chat:
    if body.get("top_logprobs") is not None:
      raise bad("'top_logprobs' is a chat field; completions take 'logprobs' (0-"
                f"{MAX_TOP_LOGPROBS})", "top_logprobs")
    top = _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    return -1 if top is None else top
  on = body.get("logprobs")
  if on is not None and not isinstance(on, bool):
    raise bad("'logprobs' must be a boolean", "logprobs")
  top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
  if top is not None and not on:
    raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
  return (top or 0) if on else -1


def parse_json(raw: bytes) -> Any:
  try:
    return json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise bad(f"the request body is not valid JSON: {e}") from None


def parse_completion(body: dict, served_model: str) -> GenerationRequest:
  """``POST /v1/completions``."""
  fields = _common(body, served_model)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one
  if isinstance(prompt, str):
    if not prompt:
      raise bad("'prompt' must not be empty", "prompt")
    return GenerationRequest(prompt_text=prompt, prompt_ids=None, chat=False, **fields)
  if isinstance(prompt, list):
    if not prompt:
      raise bad("'prompt' must not be empty", "prompt")
    if isinstance(prompt[0], (str, list)):
      raise bad("only one prompt per request is supported", "prompt")
    return GenerationRequest(prompt_text=None, prompt_ids=_token_ids(prompt, "prompt"),
                             chat=False, **fields)
  raise bad("'prompt' is required: a string or a list of token ids", "prompt")


def parse_chat(body: dict, served_model: str) -> tuple[dict, list[dict]]:
  """``POST /v1/chat/completions``: (fields, messages); the caller renders the
  messages with the chat template (tokenization.ChatTemplate)."""
  fields = _common(body, served_model, chat=True)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad("'messages' must be a non-empty list", "messages")
  if len(messages) > MAX_MESSAGES:
    raise bad(f"at most {MAX_MESSAGES} messages", "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                         "developer", "tool"):
      raise bad(f"messages[{i}] needs a role of system, user, assistant, developer or tool",
                "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str) for p in content):
        raise bad(f"messages[{i}].content: only text parts are supported", "messages")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise bad(f"messages[{i}].content must be a string", "messages")
    out.append({"role": m["role"], "content": content})
  if not any(m["content"] for m in out):
    raise bad("'messages' hold no text", "messages")
  return fields, out


def chat_request(fields: dict, prompt_text: str) -> GenerationRequest:
  return GenerationRequest(prompt_text=prompt_text, prompt_ids=None, chat=True, **fields)


# -- responses ----------------------------------------------------------------------------

FINISH_REASONS = {"max_tokens": "length", "stop_token": "stop", "stop": "stop",
                  "eos": "stop"}


def finish_reason(broker_reason: str) -> str:
  return FINISH_REASONS.get(broker_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def extension(summary: dict) -> dict:
  """The ``paas_jax`` field: where the request was prefilled, link bytes."""
  return {"route": summary.get("route", ""), "route_reason": summary.get("route_reason", ""),
          "route_rule": summary.get("route_rule", ""),
          "prefill_server": summary.get("prefill_server", ""),
          "decode_server": summary.get("decode_server", ""),
          "link_bytes": int(summary.get("link_bytes", 0) or 0),
          "cached_tokens": int(summary.get("cached_tokens", 0) or 0),
          "request_id": summary.get("request_id", "")}


def headers(summary: dict) -> dict[str, str]:
  ext = extension(summary)
  return {"x-paas-route": ext["route"], "x-paas-prefill-server": ext["prefill_server"],
          "x-paas-link-bytes": str(ext["link_bytes"]), "x-request-id": ext["request_id"]}


def completion_body(req: GenerationRequest, rid: str, text: str, token_ids: list[int],
                    reason: str, prompt_tokens: int, summary: dict,
                    logprobs: dict | None = None) -> dict:
  """``logprobs``: the choice's ``logprobs`` object (``logprob_format``), None
  when the request did not ask."""
  created = int(time.time())
  if req.chat:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "finish_reason": reason, "logprobs": logprobs}
    obj = "chat.completion"
  else:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    obj = "text_completion"
  choice["token_ids"] = token_ids  # extension (vLLM's return_token_ids)
  return {"id": rid, "object": obj, "created": created, "model": req.model,
          "choices": [choice], "usage": usage(prompt_tokens, len(token_ids)),
          "paas_jax": extension(summary)}


def stream_chunk(req: GenerationRequest, rid: str, created: int, *, text: str | None,
                 token_ids: list[int], reason: str | None, first: bool = False,
                 logprobs: dict | None = None) -> dict:
  """``logprobs``: this chunk's tokens' ``logprobs`` object (or None)."""
  if req.chat:
    delta: dict = {"role": "assistant"} if first else {}
    if text is not None:
      delta["content"] = text
    choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
    obj = "text_completion"
  choice["token_ids"] = token_ids
  return {"id": rid, "object": obj, "created": created, "model": req.model,
          "choices": [choice]}


def sse(data: dict | str) -> bytes:
  payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
  return f"data: {payload}\n\n".encode()
