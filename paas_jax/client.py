"""Client of the paas-jax broker: a Python API and a command line.

  from paas_jax.client import BrokerClient
  with BrokerClient("127.0.0.1:50050") as client:
    for chunk in client.stream(prompt="Hello", max_new_tokens=16):
      print(chunk.text, end="")
    out = client.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, seed=7)
    print(out.tokens, out.route, out.ttft_s, out.tpot_s)

  python -m paas_jax.client --broker=127.0.0.1:50050 --prompt="Hello" --max_new_tokens=16

Over TLS with a bearer token (a broker started with certificates and tokens)::

  creds = paas_jax.security.channel_credentials("certs/ca.pem", token=token)
  BrokerClient("127.0.0.1:50050", credentials=creds)

  python -m paas_jax.client --broker=127.0.0.1:50050 --tls_ca=certs/ca.pem \
      --api_token_file=certs/client.token --prompt="Hello"
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Iterator, Sequence

import grpc
from absl import app, flags
from google.protobuf import json_format

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security import channel_credentials, read_token
from paas_jax.serving.logprobs import TokenLogprob

DEFAULT_BROKER = "127.0.0.1:50050"
_ROUTES = {"auto": serving_pb2.ROUTE_AUTO, "local": serving_pb2.ROUTE_LOCAL,
           "remote": serving_pb2.ROUTE_REMOTE}


class GenerationError(Exception):
  """The broker refused or failed the request; ``code`` is the gRPC status."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(f"{code.name}: {message}")
    self.code = code
    self.message = message


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Tokens as they arrive."""

  token_ids: tuple[int, ...]
  text: str
  arrived_s: float  # seconds since the call started
  finished: bool
  finish_reason: str
  summary: dict
  # With logprobs=True: one TokenLogprob per token of token_ids.
  logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
  """A finished request, as seen by the client.

  ``ttft_s``: call to first token; ``tpot_s``: mean time per output token after
  the first. ``summary``: the broker's RequestSummary (route, where it was
  prefilled, link bytes and transfer time, server-side timings).
  """

  request_id: str
  tokens: list[int]
  text: str
  finish_reason: str
  ttft_s: float
  tpot_s: float
  total_s: float
  summary: dict
  logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)

  @property
  def route(self) -> str:
    return self.summary.get("route", "")


def _summary_dict(s: serving_pb2.RequestSummary) -> dict:
  return json_format.MessageToDict(s, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True)


class Stream:
  """Iterates ``Chunk``s of one request; ``cancel()`` abandons it (the broker
  cancels everything downstream)."""

  def __init__(self, call, started: float):
    self._call = call
    self._started = started

  def cancel(self) -> None:
    self._call.cancel()

  def __iter__(self) -> Iterator[Chunk]:
    try:
      for msg in self._call:
        yield Chunk(token_ids=tuple(msg.token_ids), text=msg.text,
                    arrived_s=time.perf_counter() - self._started, finished=msg.finished,
                    finish_reason=msg.finish_reason,
                    summary=_summary_dict(msg.summary) if msg.HasField("summary") else {},
                    logprobs=tuple(TokenLogprob(m.token_id, m.logprob, tuple(m.top_ids),
                                                tuple(m.top_logprobs)) for m in msg.logprobs))
    except grpc.RpcError as e:
      if e.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
        return
      raise GenerationError(e.code(), e.details() or "") from None


class BrokerClient:
  """Talks to a broker; every call carries a deadline (``timeout_s``)."""

  def __init__(self, target: str = DEFAULT_BROKER, *,
               credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 120.0):
    options = [("grpc.max_send_message_length", 64 << 20),
               ("grpc.max_receive_message_length", 64 << 20)]
    self.channel = (grpc.insecure_channel(target, options=options) if credentials is None
                    else grpc.secure_channel(target, credentials, options=options))
    self.stub = serving_pb2_grpc.BrokerStub(self.channel)
    self.timeout_s = timeout_s

  def __enter__(self) -> "BrokerClient":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    self.channel.close()

  def stream(self, *, prompt_ids: Sequence[int] | None = None, prompt: str | None = None,
             max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = (),
             model: str = "", route: str = "auto", request_id: str = "",
             timeout_s: float | None = None, logprobs: bool = False,
             top_logprobs: int = 0) -> Stream:
    """Starts a request; ``logprobs``: each chunk carries its tokens'
    ``TokenLogprob`` (``top_logprobs`` alternatives, 0..20)."""
    if route not in _ROUTES:
      raise ValueError(f"route must be one of {sorted(_ROUTES)}, got {route!r}")
    request = serving_pb2.GenerateRequest(
        model=model, prompt_ids=list(prompt_ids or []), prompt=prompt or "",
        max_new_tokens=max_new_tokens,
        sampling=serving_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed, stop_tokens=list(stop_tokens), request_id=request_id,
        route=_ROUTES[route], logprobs=logprobs, top_logprobs=top_logprobs)
    started = time.perf_counter()
    call = self.stub.Generate(request, timeout=timeout_s or self.timeout_s)
    return Stream(call, started)

  def generate(self, **kwargs) -> GenerationOutput:
    """Runs one request to the end (see ``stream`` for the arguments)."""
    tokens: list[int] = []
    text = []
    times: list[float] = []
    summary: dict = {}
    reason = ""
    total = 0.0
    lps: list[TokenLogprob] = []
    for chunk in self.stream(**kwargs):
      tokens.extend(chunk.token_ids)
      lps.extend(chunk.logprobs)
      text.append(chunk.text)
      times.extend([chunk.arrived_s] * len(chunk.token_ids))
      if chunk.summary:
        summary = chunk.summary
      if chunk.finished:
        reason = chunk.finish_reason
        total = chunk.arrived_s
    if not reason:
      raise GenerationError(grpc.StatusCode.CANCELLED, "the stream ended without finishing")
    ttft = times[0] if times else total
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return GenerationOutput(request_id=summary.get("request_id", ""), tokens=tokens,
                            text="".join(text), finish_reason=reason, ttft_s=ttft,
                            tpot_s=tpot, total_s=total, summary=summary, logprobs=lps)

  def stats(self, timeout_s: float = 10.0) -> dict:
    r = self.stub.GetStats(serving_pb2.StatsRequest(), timeout=timeout_s)
    out = dict(r.gauges)
    out.update(json.loads(r.json or "{}"))
    return out


# -- command line ---------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n}"


def main(argv) -> int:
  del argv
  f = flags.FLAGS
  if not f.prompt and not f.prompt_ids:
    print("error: give --prompt or --prompt_ids", file=sys.stderr)
    return 2
  credentials = None
  if f.tls_ca:
    credentials = channel_credentials(f.tls_ca, f.tls_cert, f.tls_key,
                                      token=read_token(f.api_token_file))
  elif f.api_token_file:
    print("error: --api_token_file needs --tls_ca (tokens never travel in plaintext)",
          file=sys.stderr)
    return 2
  try:
    with BrokerClient(f.broker, timeout_s=f.timeout_s, credentials=credentials) as client:
      stream = client.stream(
          prompt=f.prompt, prompt_ids=[int(t) for t in f.prompt_ids or []],
          max_new_tokens=f.max_new_tokens, temperature=f.temperature, top_k=f.top_k,
          top_p=f.top_p, seed=f.seed, stop_tokens=[int(t) for t in f.stop_tokens],
          model=f.model, route=f.route)
      tokens, times, summary, reason = [], [], {}, ""
      for chunk in stream:
        if not f.json:
          shown = chunk.text if (f.show == "text" and chunk.text) else (
              " ".join(str(t) for t in chunk.token_ids) + " " if chunk.token_ids else "")
          sys.stdout.write(shown)
          sys.stdout.flush()
        tokens.extend(chunk.token_ids)
        times.extend([chunk.arrived_s] * len(chunk.token_ids))
        summary = chunk.summary or summary
        reason = chunk.finish_reason or reason
  except GenerationError as e:
    print(f"\nerror: {e}", file=sys.stderr)
    return 1
  except grpc.RpcError as e:
    print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1
  ttft = times[0] if times else 0.0
  tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
  route = summary.get("route", "?")
  where = {"pdp": "locally in the PD region (PD-P)",
           "prfaas": "remotely in the PrfaaS region"}.get(route, route)
  report = {"tokens": tokens, "finish_reason": reason, "ttft_s": ttft, "tpot_s": tpot,
            "route": route, "summary": summary}
  if f.json:
    print(json.dumps(report))
    return 0
  print()
  print(f"request   : {summary.get('request_id', '')}  ({len(tokens)} tokens, {reason})")
  print(f"prefilled : {where}; {summary.get('route_reason', '')}")
  print(f"TTFT      : {ttft * 1e3:.1f} ms    TPOT: {tpot * 1e3:.2f} ms")
  if route == "prfaas":
    print(f"link      : {_fmt_bytes(float(summary.get('link_bytes', 0)))} in "
          f"{float(summary.get('transfer_s', 0)) * 1e3:.1f} ms "
          f"(state {_fmt_bytes(float(summary.get('state_bytes', 0)))})")
  else:
    print("link      : 0 B (state stayed in the PD region)")
  return 0


def _define_flags():
  flags.DEFINE_string("broker", DEFAULT_BROKER, "Broker address host:port.")
  flags.DEFINE_string("prompt", None, "Prompt text (byte-level for random-init models).")
  flags.DEFINE_list("prompt_ids", None, "Comma-separated prompt token ids.")
  flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate (> 0).")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_integer("top_k", 0, "0 = no top-k filter.")
  flags.DEFINE_float("top_p", 1.0, "1 = no nucleus filter.")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_list("stop_tokens", [], "Token ids that end generation.")
  flags.DEFINE_string("model", "", "Model name (empty: the broker's default).")
  flags.DEFINE_enum("route", "auto", sorted(_ROUTES), "Override the broker's routing.")
  flags.DEFINE_float("timeout_s", 120.0, "Deadline of the whole request.")
  flags.DEFINE_enum("show", "ids", ["ids", "text"], "Print streamed token ids or text.")
  flags.DEFINE_bool("json", False, "Print one JSON object at the end instead.")
  flags.DEFINE_string("tls_ca", None, "CA of the broker's certificate: connect over TLS.")
  flags.DEFINE_string("tls_cert", None, "Client certificate (brokers that require one).")
  flags.DEFINE_string("tls_key", None, "Client certificate key.")
  flags.DEFINE_string("api_token_file", None, "Bearer token file (default "
                      "$PAAS_JAX_API_TOKEN when --tls_ca is given).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
