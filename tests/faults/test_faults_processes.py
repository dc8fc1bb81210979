"""Real processes killed mid-request: a secured LocalCluster (mutual TLS,
bearer token) whose prefill server kills itself in the middle of its first
state transfer (``--faults=kill_after_layers=2``, i.e. ``os._exit(137)``
like a preempted machine), and a decode server that gets SIGKILL while it
streams tokens. Both restart on their old ports and rejoin through health
checks. In the default suite (issue 12): one process kill per side, on one small
cluster (three processes start, two restart; about a minute warm)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.serving.launch import ClusterSpec, LocalCluster
# Single-process generation of the same weights (tiny_gdn_gqa, seed 0).
from tests.serving.conftest import assert_logprobs, ref_model, reference  # noqa: F401  (fixtures)

LONG, SHORT = 120, 20


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(900 + salt).integers(1, 256, n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=2, threshold=48, tls=True, metrics=True,
                     prefill_faults="kill_after_layers=2", log_level="INFO",
                     log_format="json")
  c = LocalCluster(spec, tmp_path_factory.mktemp("faulty_cluster")).start()
  yield c
  c.stop()


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120,
                    credentials=cluster.client_credentials()) as c:
    yield c


def test_prefill_killed_mid_transfer_reprefills_with_the_same_tokens(cluster, client,
                                                                     reference,
                                                                     assert_logprobs):
  prompt = _prompt(LONG, 1)
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="killed-prefill",
                        logprobs=True, top_logprobs=3)
  assert cluster.procs["prefill"].popen.wait(10) == 137  # it really died mid-transfer
  assert out.tokens == reference(tuple(prompt), 8)
  assert_logprobs(prompt, out)  # the re-prefilled state's logits, not only its tokens
  assert out.route == "pdp" and "fallback" in out.summary["route_reason"]
  # The broker's log names the request and the reroute.
  log = (cluster.workdir / "broker.log").read_text()
  assert '"request_id": "killed-prefill"' in log and "retrying" in log
  # Restarted without the fault on the same port: it rejoins, long prompts go remote.
  cluster.restart("prefill", drop_prefix="--faults")
  deadline = time.monotonic() + 20
  while True:
    prompt = _prompt(LONG, 2)
    out = client.generate(prompt_ids=prompt, max_new_tokens=8)
    if out.route == "prfaas" or time.monotonic() > deadline:
      break
    time.sleep(0.5)
  assert out.route == "prfaas" and out.tokens == reference(tuple(prompt), 8)


def test_decode_sigkill_fails_requests_with_a_status_and_it_rejoins(cluster, client,
                                                                    reference):
  results: dict = {}
  streaming = threading.Event()

  def run(i):
    try:
      got = []
      for chunk in client.stream(prompt_ids=_prompt(SHORT + i, 10 + i), max_new_tokens=200):
        got.extend(chunk.token_ids)
        streaming.set()
      results[i] = got
    except GenerationError as e:
      results[i] = e
  threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
  for t in threads:
    t.start()
  assert streaming.wait(60)
  killed = time.monotonic()
  assert cluster.kill("decode") == -9
  for t in threads:
    t.join(60)
  assert time.monotonic() - killed < 15  # nothing hangs until the 120 s deadline
  for r in results.values():
    assert isinstance(r, GenerationError) and r.code.name == "UNAVAILABLE", r
    assert "decode server" in r.message
  with pytest.raises(GenerationError) as e:
    client.generate(prompt_ids=_prompt(SHORT, 20), max_new_tokens=2, timeout_s=30)
  assert e.value.code.name == "UNAVAILABLE"
  cluster.restart("decode")
  deadline = time.monotonic() + 20
  for n, salt in ((SHORT, 21), (LONG, 22)):
    prompt = _prompt(n, salt)
    while True:
      try:
        out = client.generate(prompt_ids=prompt, max_new_tokens=8)
        break
      except GenerationError as err:  # until the broker's probe sees it back
        assert err.code.name == "UNAVAILABLE" and time.monotonic() < deadline, err
        time.sleep(0.3)
    assert out.tokens == reference(tuple(prompt), 8)
