"""The OpenAI API against a real deployment (gateway, broker, both regions, the
WAN relay), with the official ``openai`` client over TLS with a bearer token.
Tokens are compared with single-process generation of the same weights."""

from __future__ import annotations

import json
import ssl
import time

import grpc
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paas_jax.frontdoor.tokenization import ChatTemplate
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving.child_process import spawn, wait_ready

from tests.frontdoor.conftest import CONFIG, LONG, MAX_CTX, SHORT

MODEL = CONFIG  # random-init configs serve under their config name


def _prompt(length: int, salt: int) -> list[int]:
  rng = np.random.default_rng(2000 + salt)
  return [int(t) for t in rng.integers(0, 256, length)]


def _ids(choice) -> list[int]:
  return list(choice.model_extra["token_ids"])


@pytest.mark.parametrize("length,route", [(SHORT, "pdp"), (LONG, "prfaas")])
def test_completion_token_ids_exact(oai, reference, length, route):
  prompt = _prompt(length, length)
  raw = oai.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=10,
                                                 temperature=0.0)
  out = raw.parse()
  assert _ids(out.choices[0]) == list(reference(tuple(prompt), 10))
  assert out.choices[0].finish_reason == "length"
  assert out.usage.prompt_tokens == length and out.usage.completion_tokens == 10
  # Where it was prefilled, in the headers and in the extension field.
  assert raw.headers["x-paas-route"] == route == out.model_extra["paas_jax"]["route"]
  link = int(raw.headers["x-paas-link-bytes"])
  assert (link > 0) == (route == "prfaas")
  # A different prompt gives different tokens (the comparison can fail).
  assert _ids(out.choices[0]) != list(reference(tuple(prompt[:-1]), 10))


def test_completion_stream_sampled_matches(oai, reference):
  prompt = _prompt(LONG, 7)
  stream = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9,
                                  top_p=0.95, seed=5, stream=True,
                                  stream_options={"include_usage": True},
                                  extra_body={"top_k": 40})
  tokens, reasons, usage, ext = [], [], None, None
  for chunk in stream:
    if chunk.usage is not None:
      usage = chunk.usage
    for c in chunk.choices:
      tokens.extend(c.model_extra["token_ids"])
      reasons.append(c.finish_reason)
    ext = (chunk.model_extra or {}).get("paas_jax", ext)
  assert tokens == list(reference(tuple(prompt), 12, 0.9, 40, 0.95, 5))
  assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
  assert usage.completion_tokens == 12 and usage.prompt_tokens == LONG
  assert ext["route"] == "prfaas" and ext["link_bytes"] > 0


def test_stream_ends_with_done(http, gateway_cluster):
  r = http.post("/v1/completions", headers={"Authorization": f"Bearer {gateway_cluster.token}"},
                json={"model": MODEL, "prompt": _prompt(SHORT, 3), "max_tokens": 4,
                      "stream": True, "temperature": 0})
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
  events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  assert all("error" not in json.loads(e) for e in events[:-1])


def test_text_prompt_is_tokenized_by_the_broker(oai, reference):
  text = "The prefill region sends its state over the link. " * 2
  out = oai.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0.0)
  ids = list(text.encode())  # the random-init config's declared byte tokenizer
  assert out.usage.prompt_tokens == len(ids)
  assert _ids(out.choices[0]) == list(reference(tuple(ids), 6))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_template_then_generation(oai, reference, stream):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Where was I prefilled?"}]
  ids = list(ChatTemplate().render(messages).encode())
  kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
  if stream:
    tokens, text = [], []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
      for c in chunk.choices:
        tokens.extend(c.model_extra["token_ids"])
        text.append(c.delta.content or "")
  else:
    out = oai.chat.completions.create(**kwargs)
    tokens, text = _ids(out.choices[0]), [out.choices[0].message.content]
    assert out.usage.prompt_tokens == len(ids)
  expected = list(reference(tuple(ids), 8))
  assert tokens == expected
  assert "".join(text) == bytes(expected).decode("utf-8", errors="replace")


def test_stop_string_cuts_text(oai, reference):
  prompt = _prompt(SHORT, 11)
  full = bytes(reference(tuple(prompt), 24)).decode("utf-8", errors="replace")
  # A stop string from the middle of the answer: the text ends right before it.
  k = len(full) // 2
  stop = full[k:k + 2]
  expected = full[:full.find(stop)]
  out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                               stop=[stop])
  assert out.choices[0].finish_reason == "stop"
  assert out.choices[0].text == expected
  streamed = "".join(c.choices[0].text for c in oai.completions.create(
      model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, stop=stop, stream=True)
      if c.choices)
  assert streamed == expected


def test_models_health_metrics(oai, http):
  assert [m.id for m in oai.models.list().data] == [MODEL]
  assert http.get("/health").status_code == 200
  r = http.get("/metrics")
  families = {f.name: f for f in text_string_to_metric_families(r.text)}
  ok = [s.value for s in families["paas_http_requests"].samples
        if s.name == "paas_http_requests_total" and s.labels["status"] == "200"]
  assert sum(ok) >= 1
  assert "paas_http_ttft_seconds" in families


def _error(r, status: int, param=None):
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"]
  if param is not None:
    assert err["param"] == param
  return err


BAD = [
    ({"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"model": MODEL, "prompt": [], "max_tokens": 4}, 400, "prompt"),
    ({"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": "hot"}, 400,
     "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": [1, 2, 99999], "max_tokens": 4}, 400, None),
    ({"model": MODEL, "prompt": [1] * (MAX_CTX + 10), "max_tokens": 4}, 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input(http, gateway_cluster, body, status, param):
  r = http.post("/v1/completions", json=body,
                headers={"Authorization": f"Bearer {gateway_cluster.token}"})
  _error(r, status, param)


def test_bad_input_chat_and_json(http, gateway_cluster):
  auth = {"Authorization": f"Bearer {gateway_cluster.token}"}
  _error(http.post("/v1/chat/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"}), 400)
  _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []},
                   headers=auth), 400, "messages")
  # The control: a good body on the same path is accepted.
  assert http.post("/v1/chat/completions", headers=auth, json={
      "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "max_tokens": 2}).status_code == 200


def test_auth(http, gateway_cluster, oai):
  body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
  _error(http.post("/v1/completions", json=body), 401)
  _error(http.post("/v1/completions", json=body,
                   headers={"Authorization": "Bearer " + "x" * 40}), 403)
  _error(http.get("/v1/models", headers={"Authorization": "Basic abc"}), 401)
  with pytest.raises(openai.PermissionDeniedError):
    oai.with_options(api_key="y" * 40).completions.create(**body)
  with pytest.raises(openai.BadRequestError):
    oai.completions.create(model=MODEL, prompt="hi", max_tokens=0)
  with pytest.raises(openai.NotFoundError):
    oai.completions.create(model="other", prompt="hi", max_tokens=2)


def _broker_record(cluster, request_id: str) -> dict | None:
  """The broker's record of a finished request (GetStats ``recent``), or None."""
  creds = cluster.client_credentials()
  with grpc.secure_channel(cluster.broker_address, creds) as ch:
    r = serving_pb2_grpc.BrokerStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return next((rec for rec in json.loads(r.json)["recent"]
               if rec["request_id"] == request_id), None)


def _decode_busy(cluster) -> float:
  with cluster.channel("decode") as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return r.gauges["slots_busy"]


def _wait_record(cluster, request_id: str) -> dict:
  deadline = time.monotonic() + 20
  while (rec := _broker_record(cluster, request_id)) is None:
    assert time.monotonic() < deadline, f"{request_id} never ended at the broker"
    time.sleep(0.05)
  return rec


@pytest.mark.parametrize("disconnect", [True, False])
def test_disconnect_cancels_downstream(http, gateway_cluster, disconnect):
  max_tokens = MAX_CTX - SHORT - 1
  body = {"model": MODEL, "prompt": _prompt(SHORT, 21), "max_tokens": max_tokens,
          "stream": True, "temperature": 0, "ignore_eos": True}
  with http.stream("POST", "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {gateway_cluster.token}"}) as r:
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]
    lines = r.iter_lines()
    next(lines)
    if not disconnect:  # the control: a client that stays gets everything
      assert [x for x in lines if x][-1] == "data: [DONE]"
  rec = _wait_record(gateway_cluster, request_id)
  if disconnect:
    assert rec["phase"] == "cancelled" and rec["client_gone"]
    assert rec["generated"] < max_tokens
  else:
    assert rec["phase"] == "finished" and rec["generated"] == max_tokens
  deadline = time.monotonic() + 20
  while _decode_busy(gateway_cluster) != 0:  # the decode slot is free again
    assert time.monotonic() < deadline
    time.sleep(0.05)
  if disconnect:
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert families["paas_http_client_disconnects"].samples[0].value >= 1


def test_overload_is_429(gateway_cluster, tmp_path):
  """A second gateway on the same broker that admits no generation at all."""
  certs = gateway_cluster.certs
  proc = spawn("gateway_full", ["-m", "paas_jax.frontdoor",
                                f"--broker={gateway_cluster.broker_address}", "--port=0",
                                "--max_inflight=0", f"--tls_dir={certs}", "--tls_name=broker",
                                f"--api_tokens_file={certs / 'api_tokens.txt'}",
                                f"--api_token_file={certs / 'client.token'}"], tmp_path)
  try:
    wait_ready([proc], 60)
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=certs / "ca.pem"),
                                   timeout=30) as h:
      client = openai.OpenAI(base_url=f"https://127.0.0.1:{proc.info['port']}/v1",
                             api_key=gateway_cluster.token, http_client=h, max_retries=0)
      with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
      assert [m.id for m in client.models.list().data] == [MODEL]  # the rest still works
  finally:
    proc.stop()
