"""The gateway's side of the broker: async gRPC calls, each with a deadline.

One ``grpc.aio`` channel to the broker's public port. ``generate`` forwards
the HTTP caller's bearer token as the call's ``authorization`` metadata, so
the broker's own token check applies to HTTP callers exactly as to gRPC
ones. Cancelling the returned call (the HTTP client went away, a stop string
matched) makes the broker cancel everything downstream: the decode slot and
any state transfer.
"""

from __future__ import annotations

import dataclasses

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paas_jax.frontdoor.protocol import GenerationRequest
from paas_jax.proto import serving_pb2, serving_pb2_grpc

CONTROL_TIMEOUT_S = 10.0
_ROUTES = {"auto": serving_pb2.ROUTE_AUTO, "local": serving_pb2.ROUTE_LOCAL,
           "remote": serving_pb2.ROUTE_REMOTE}
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                    ("grpc.max_receive_message_length", 64 << 20)]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
  """What the broker serves (its typed ``GetModel`` answer, ``ServedModel``).

  ``name``: the served model name clients must send; ``max_model_len``:
  context (prompt + output) per request; ``tokenizer``: "checkpoint",
  "byte" or "" (no text prompts); ``chat_template``: jinja source or None;
  ``special``: bos/eos token strings for the template.
  """

  name: str
  max_model_len: int
  tokenizer: str
  chat_template: str | None
  special: dict

  @classmethod
  def from_served(cls, served: serving_pb2.ServedModel, name_override: str = "") -> "ModelInfo":
    return cls(name=name_override or served.name, max_model_len=int(served.max_model_len),
               tokenizer=served.tokenizer, chat_template=served.chat_template or None,
               special=dict(served.special_tokens))


def generate_request(req: GenerationRequest, request_id: str) -> serving_pb2.GenerateRequest:
  msg = serving_pb2.GenerateRequest(
      model=req.model, prompt=req.prompt_text or "", prompt_ids=list(req.prompt_ids or ()),
      max_new_tokens=req.max_tokens, seed=req.seed, stop_tokens=list(req.stop_token_ids),
      request_id=request_id, route=_ROUTES[req.route],
      sampling=serving_pb2.SamplingParams(temperature=req.temperature, top_k=req.top_k,
                                          top_p=req.top_p))
  # Fields a newer broker contract has (EOS handling, chat prompts); absent
  # ones are simply not sent.
  fields = msg.DESCRIPTOR.fields_by_name
  if "ignore_eos" in fields:
    msg.ignore_eos = req.ignore_eos
  if "prompt_has_special_tokens" in fields:
    msg.prompt_has_special_tokens = req.chat
  if req.logprobs >= 0:
    msg.logprobs, msg.top_logprobs = True, req.logprobs
  return msg


class BrokerBackend:
  """Async client of the broker.

  Args:
    target: the broker's host:port.
    credentials: TLS channel credentials (None: plaintext).
    timeout_s: deadline of a whole generation.
    token: the gateway's own bearer token, for its GetModel calls (the model
      list); generation calls carry the HTTP caller's token instead.
  """

  def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
               timeout_s: float = 600.0, token: str | None = None,
               target_name: str | None = None):
    options = list(_CHANNEL_OPTIONS)
    if target_name:
      options.append(("grpc.ssl_target_name_override", target_name))
    self.channel = (grpc.aio.insecure_channel(target, options=options) if credentials is None
                    else grpc.aio.secure_channel(target, credentials, options=options))
    self.stub = serving_pb2_grpc.BrokerStub(self.channel)
    self.health_stub = health_pb2_grpc.HealthStub(self.channel)
    self.timeout_s = timeout_s
    self.token = token

  @staticmethod
  def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None

  async def model_info(self, name_override: str = "") -> ModelInfo:
    served = await self.stub.GetModel(serving_pb2.ModelRequest(), timeout=CONTROL_TIMEOUT_S,
                                      metadata=self._metadata(self.token))
    return ModelInfo.from_served(served, name_override)

  async def healthy(self) -> bool:
    try:
      r = await self.health_stub.Check(health_pb2.HealthCheckRequest(),
                                       timeout=CONTROL_TIMEOUT_S / 2)
    except grpc.aio.AioRpcError:
      return False
    return r.status == health_pb2.HealthCheckResponse.SERVING

  def generate(self, req: GenerationRequest, request_id: str, token: str | None):
    """The streaming call (``async for msg in call``; ``call.cancel()``)."""
    return self.stub.Generate(generate_request(req, request_id), timeout=self.timeout_s,
                              metadata=self._metadata(token))

  async def close(self) -> None:
    await self.channel.close()
