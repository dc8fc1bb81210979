"""GetModel: the served model as a typed message (``ServedModel``), not JSON
read back out of GetStats. Real gRPC servers in this process (a PD node and a
broker, the tiny model): the broker learns a checkpoint's config from the PD
node, the OpenAI gateway's backend reads the broker's served name, context,
chat template and special tokens. Negative controls: a config that does not
match its announced fingerprint, or none at all, is refused."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from paas_jax.frontdoor.backend import BrokerBackend
from paas_jax.models import load_config
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import broker, common, control_plane, decode_server
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.routing import StaticThresholdPolicy
from paas_jax.serving.tokenizer import ServedText

CONFIG = "tiny_gdn_gqa"
MAX_CTX = 128
TEXT = ServedText(name="served-tiny", kind="", chat_template="{{ messages }}",
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, eos_token_ids=(2, 3))


@pytest.fixture(scope="module")
def stack():
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(CONFIG, 0)
  d = decode_server.start(model, EngineConfig(n_slots=1, max_ctx=MAX_CTX,
                                              prefill_buckets=(64,), prefill_max_batch=1),
                          max_queue=1, warmup=False)
  b = broker.start(model.config, StaticThresholdPolicy(32), prefill_targets=[],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)],
                   text=TEXT)
  yield {"model": model, "decode": d, "broker": b}
  b.stop()
  d.stop()


def test_pd_node_serves_its_config_typed(stack):
  cfg = stack["model"].config
  with grpc.insecure_channel(stack["decode"].address) as ch:
    served = serving_pb2_grpc.DecodeStub(ch).GetModel(serving_pb2.ModelRequest(), timeout=10)
  assert served.name == cfg.name and served.config_fingerprint == cfg.fingerprint()
  assert served.vocab_size == cfg.vocab_size and served.max_model_len == MAX_CTX
  assert served.tokenizer == "" and not served.special_tokens
  # What a broker serving a checkpoint does at start.
  assert broker.model_config_from_decode(stack["decode"].address) == load_config(CONFIG)


def test_gateway_reads_the_brokers_served_model(stack):
  cfg = stack["model"].config
  with grpc.insecure_channel(stack["broker"].address) as ch:
    served = serving_pb2_grpc.BrokerStub(ch).GetModel(serving_pb2.ModelRequest(), timeout=10)
  assert served.name == "served-tiny" and served.config_fingerprint == cfg.fingerprint()
  assert list(served.eos_token_ids) == [2, 3]

  async def info():
    backend = BrokerBackend(stack["broker"].address)
    try:
      return await backend.model_info(), await backend.model_info("override")
    finally:
      await backend.channel.close()
  got, renamed = asyncio.run(info())
  assert (got.name, got.max_model_len, got.tokenizer) == ("served-tiny", cfg.max_seq_len, "")
  assert got.chat_template == "{{ messages }}"
  assert got.special == {"bos_token": "<s>", "eos_token": "</s>"}
  assert renamed.name == "override"


def test_a_config_that_does_not_match_its_fingerprint_is_refused():
  cfg = load_config(CONFIG)
  served = control_plane.served_model(cfg, max_model_len=MAX_CTX)
  assert control_plane.model_config(served, type(cfg).from_dict) == cfg
  d = json.loads(served.config_json)
  d["vocab_size"] += 1  # another model behind the same announced fingerprint
  bad = serving_pb2.ServedModel()
  bad.CopyFrom(served)
  bad.config_json = json.dumps(d)
  with pytest.raises(control_plane.InvalidServedModel, match="fingerprint"):
    control_plane.model_config(bad, type(cfg).from_dict)
  bad.config_json = ""
  with pytest.raises(control_plane.InvalidServedModel, match="without its config"):
    control_plane.model_config(bad, type(cfg).from_dict)
  bad.config_json = "{not json"
  with pytest.raises(control_plane.InvalidServedModel, match="unreadable"):
    control_plane.model_config(bad, type(cfg).from_dict)
