"""An OpenAI-compatible HTTP front door for the broker (issue 18).

A gateway process beside the broker: ``python -m paas_jax.frontdoor
--broker=HOST:PORT``. Built on aiohttp (async streaming and server-sent
events in one small dependency, no pydantic/starlette stack to pin), with
``grpc.aio`` to the broker on the same event loop, so a client that goes
away cancels its gRPC call and the broker frees the decode slot.

  protocol.py      request parsing, response and OpenAI error bodies (pure)
  tokenization.py  chat templates, stop strings
  logprob_format.py  OpenAI's logprobs objects from the broker's TokenLogprob
  backend.py       async gRPC client of the broker, with deadlines
  app.py           routes, auth, metrics, streaming
  server.py        the process: flags, TLS, bearer tokens, ready file
"""

from paas_jax.frontdoor.app import Gateway, GatewayConfig, make_app
from paas_jax.frontdoor.backend import BrokerBackend, ModelInfo
from paas_jax.frontdoor.protocol import APIError, GenerationRequest

__all__ = ["APIError", "BrokerBackend", "Gateway", "GatewayConfig", "GenerationRequest",
           "ModelInfo", "make_app"]
