"""A decode server dies while it streams: with a second healthy decode server the
broker restarts the request from a prefill there and the client still gets
exactly the tokens of single-process generation, none twice."""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.client import BrokerClient


@pytest.fixture(scope="module")
def stack():
  from paas_jax.models import api
  from paas_jax.serving import broker, common, decode_server, prefill_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  model, _ = common.load_model("tiny_gdn_gqa", 0)
  ec = EngineConfig(n_slots=4, max_ctx=256, prefill_buckets=(64,), prefill_max_batch=2)
  decodes = [decode_server.start(model, ec, max_queue=8) for _ in range(2)]
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(48), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)
                                   for d in decodes], health_interval_s=0.3)
  yield {"broker": b, "decodes": decodes, "prefill": p,
         "reference": lambda prompt, n, **kw: api.generate(
             model, prompt, n, sampling=api.SamplingParams(kw.get("temperature", 0.0)),
             seed=kw.get("seed", 0)).tokens}
  b.stop()
  p.stop()
  for d in decodes:
    try:
      d.stop()
    except Exception:  # pylint: disable=broad-except
      pass


@pytest.mark.parametrize("length,temperature", [(20, 0.0), (120, 0.9)])
def test_request_survives_its_decode_server(stack, length, temperature):
  prompt = [int(t) for t in np.random.default_rng(length).integers(1, 256, length)]
  n = min(160, 250 - length)
  tokens, first, final = [], None, None
  with BrokerClient(stack["broker"].address, timeout_s=60) as client:
    for chunk in client.stream(prompt_ids=prompt, max_new_tokens=n, seed=7,
                               temperature=temperature):
      tokens.extend(chunk.token_ids)
      if first is None and chunk.summary:
        first = chunk.summary
        victim = next(d for d in stack["decodes"] if d.address == first["decode_server"])
        victim.control.server.stop(0)  # dies with the request mid-stream
        victim.transfer.server.stop(0)
        victim.servicer.stop()
      if chunk.finished:
        final = chunk.summary
  assert first is not None and final is not None
  assert tokens == stack["reference"](prompt, n, seed=7, temperature=temperature)
  assert final["decode_server"] != first["decode_server"]
  stats = stack["broker"].servicer.counters
  assert stats["reroutes"] >= 1
  # Bring a replacement up on the dead one's ports for the next case.
  from paas_jax.serving import decode_server
  i = stack["decodes"].index(victim)
  stack["decodes"][i] = decode_server.start(victim.servicer.model,
                                            victim.servicer.engine.config,
                                            port=victim.control.port,
                                            transfer_port=victim.transfer.port, max_queue=8)
  assert stack["broker"].servicer.health.wait_healthy(victim.address, 10)
