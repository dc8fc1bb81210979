"""A Hugging Face checkpoint served over the regions with its own tokenizer:
text goes through the broker as the checkpoint's tokenizer encodes it, the
served name comes from the checkpoint (not its folder), generation stops at
generation_config.json's EOS unless the request ignores it. The deployment
serves in bf16 (weights and KV bf16, recurrent state f32) and prefills every
prompt in region A, so the bf16 state crosses the codec and the transport;
answers are compared with single-process bf16 generation."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from paas_jax.frontdoor.tokenization import ChatTemplate
from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import broker as broker_lib
from paas_jax.serving import common
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.tokenizer import checkpoint_text
from tests.checkpoints import hf_tiny

NAME = "paas-jax/tiny-qwen3-next"
TEXT = "the model reads a long prompt in one region"
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m.role }} {{ m.content }}{{ eos_token }}"
            " {% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}")
N = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """(dir, tokenizer, reference greedy ids of TEXT, eos id, single-process bf16 model)."""
  d = tmp_path_factory.mktemp("hf") / "some-local-folder"
  d.mkdir()
  hf_tiny.save_family("qwen3_next", d)
  cfg = json.loads((d / "config.json").read_text())
  cfg["_name_or_path"] = NAME
  (d / "config.json").write_text(json.dumps(cfg))
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
  common.enable_compilation_cache(common.default_compilation_cache())
  f32, tok = common.load_model("", checkpoint=str(d))
  model = common.with_dtype(f32, "bfloat16")
  ids = tok.encode(TEXT).ids
  ref = api.generate(model, ids, N).tokens
  # EOS: a token the greedy answer reaches after a few steps, not before.
  k = next(i for i in range(2, N) if ref[i] not in ref[:i])
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [ref[k], 63]}))
  return d, tok, list(ref), k, model


@pytest.fixture(scope="module")
def served(ckpt):
  d = ckpt[0]
  # threshold 0: every prompt is prefilled in region A and its state transferred.
  with LocalCluster(ClusterSpec(checkpoint=str(d), n_slots=2, max_ctx=128, dtype="bfloat16",
                                prefill_buckets=(64,), http=True, threshold=0)) as c:
    with openai.DefaultHttpxClient(timeout=120) as h:
      yield c, openai.OpenAI(base_url=c.http_url, api_key="none", http_client=h,
                             max_retries=0)


def test_checkpoint_text_reads_the_folder(ckpt):
  d, tok, ref, k, _ = ckpt
  text = checkpoint_text(d, config_name="some-local-folder")
  assert text.name == NAME and text.kind == "checkpoint"
  assert text.eos_token_ids == (ref[k], 63) and text.chat_template == TEMPLATE
  assert text.tokenizer.encode(TEXT) == tok.encode(TEXT).ids
  # Bytes would be other ids (the fallback the broker no longer guesses with).
  assert tok.encode(TEXT).ids != list(TEXT.encode())


def test_text_through_the_broker_uses_the_checkpoint_tokenizer(served, ckpt):
  cluster, oai = served
  _, tok, ref, k, _ = ckpt
  assert [m.id for m in oai.models.list().data] == [NAME]
  raw = oai.completions.with_raw_response.create(model=NAME, prompt=TEXT, max_tokens=N,
                                                 temperature=0)
  assert raw.headers["x-paas-route"] == "prfaas" and int(raw.headers["x-paas-link-bytes"]) > 0
  out = raw.parse()
  assert out.usage.prompt_tokens == len(tok.encode(TEXT).ids)
  ids = out.choices[0].model_extra["token_ids"]
  # Stops at generation_config.json's EOS (included, as transformers does).
  assert ids == ref[:k + 1] and out.choices[0].finish_reason == "stop"
  assert out.choices[0].text == tok.decode(ids)
  full = oai.completions.create(model=NAME, prompt=TEXT, max_tokens=N, temperature=0,
                                extra_body={"ignore_eos": True})
  assert full.choices[0].model_extra["token_ids"] == ref
  assert full.choices[0].finish_reason == "length"


def test_chat_uses_the_checkpoint_template(served, ckpt):
  _, oai = served
  _, tok, _, _, model = ckpt
  messages = [{"role": "user", "content": "state moves over the network"}]
  rendered = ChatTemplate(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}).render(messages)
  ids = tok.encode(rendered, add_special_tokens=False).ids
  out = oai.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
  assert out.usage.prompt_tokens == len(ids)
  assert out.choices[0].model_extra["token_ids"] == list(api.generate(model, ids, 4).tokens)


def test_folder_name_is_not_the_model(served):
  cluster, oai = served
  with pytest.raises(openai.NotFoundError):
    oai.completions.create(model="some-local-folder", prompt=TEXT, max_tokens=2)
  with grpc.insecure_channel(cluster.broker_address) as ch:
    with pytest.raises(grpc.RpcError) as e:
      list(serving_pb2_grpc.BrokerStub(ch).Generate(serving_pb2.GenerateRequest(
          model="some-local-folder", prompt=TEXT, max_new_tokens=2), timeout=30))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_no_tokenizer_refuses_text(tmp_path, ckpt):
  """A checkpoint without tokenizer.json: text is refused, ids are served."""
  d = tmp_path / "no_tok"
  d.mkdir()
  (d / "config.json").write_text((ckpt[0] / "config.json").read_text())
  model = ckpt[4]
  text = broker_lib.served_text(model.config, str(d), None, declared_config=False)
  assert text.tokenizer is None and text.name == NAME
  servicer = broker_lib.BrokerServicer(
      model.config, broker_lib.make_policy("static", 1e9), prefill_targets=[],
      decode_targets=[broker_lib.DecodeTarget("127.0.0.1:1", "127.0.0.1:1")], text=text)
  try:
    with pytest.raises(broker_lib.InvalidRequestError, match="no known tokenizer"):
      servicer._parse(serving_pb2.GenerateRequest(prompt=TEXT, max_new_tokens=2))
    prompt, params = servicer._parse(serving_pb2.GenerateRequest(prompt_ids=[5, 6],
                                                                 max_new_tokens=2))
    # No generation_config.json: config.json's eos_token_id ends generation...
    assert prompt == [5, 6] and params.stop_tokens == (2,)
    # ... unless the request ignores EOS.
    _, params = servicer._parse(serving_pb2.GenerateRequest(prompt_ids=[5, 6], max_new_tokens=2,
                                                            ignore_eos=True))
    assert params.stop_tokens == ()
    # A random-init config declared by name keeps byte-level text.
    byte = broker_lib.served_text(model.config, None, None, declared_config=True)
    assert byte.kind == ("byte" if model.config.vocab_size >= 256 else "")
  finally:
    servicer.close()
