"""The prefill pod's real Prefill RPC, multi-process, in the default suite (#16).

The pod server (``python -m paas_jax.serving.pod_prefill_server
--pod_processes=2``: its supervisor and two pod processes, one JAX program,
tiny_gdn_gqa TP=2) gets a Prefill RPC as a broker sends it; the decode side
is this test's own StateReceiver with the decode server's ``PodIntake``. The
first token, its logprob and the restored state are checked against
single-process prefill (the broker, decode server and relay are in the slow
``test_pod_serving.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common, logprob_check, logprobs
from paas_jax.serving.child_process import spawn, wait_ready
from paas_jax.serving.pod_intake import PodIntake
from paas_jax.state import logit_probe, sensitivity
from paas_jax.transport.receiver import StateReceiver
from paas_jax.transport.receiver_server import serve_receiver
from tests.serving.conftest import CONFIG, SEED


class _Arrivals:
  def __init__(self):
    self.states = {}

  def state_arrived(self, rid, state, info, lossy=False):
    self.states[rid] = state

  def forget(self, rid):
    pass


@pytest.fixture(scope="module")
def pod_server(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("pod_rpc")
  proc = spawn("prefill", ["-m", "paas_jax.serving.pod_prefill_server", f"--config={CONFIG}",
                           f"--seed={SEED}", "--port=0", "--insecure", "--max_ctx=256",
                           "--prefill_buckets=64", "--pod_processes=2", "--log_level=WARNING"],
               workdir)
  try:
    wait_ready([proc], 300)
    yield proc
  finally:
    proc.stop()


def test_the_pod_answers_prefill_and_streams_its_shards(pod_server, ref_model):
  config = ref_model.config
  arrivals, failed = _Arrivals(), []
  intake = PodIntake(config, verifier=arrivals, fail=lambda *a: failed.append(a))
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=intake.template, on_ready=intake.on_state,
                           on_failure=intake.on_failure)
  server = serve_receiver(receiver, "127.0.0.1:0")
  prompt = [int(t) for t in np.random.default_rng(16).integers(1, 256, 50)]
  try:
    with common.make_channel(f"127.0.0.1:{pod_server.info['port']}") as ch:
      stub = serving_pb2_grpc.PrefillStub(ch)
      events = list(stub.Prefill(serving_pb2.PrefillRequest(
          request_id="rpc-1", model=config.name, prompt_ids=prompt, decode_target=server.target,
          logprobs=True, top_logprobs=3), timeout=120))
      gauges = stub.GetStats(serving_pb2.StatsRequest(), timeout=30).gauges
  finally:
    server.stop(grace=None)
  first = next(e.first_token for e in events if e.HasField("first_token"))
  done = next(e.done for e in events if e.HasField("done"))
  assert not failed and done.num_streams == 2 and done.bytes_sent > 0
  # The first token and its logprob are single-process prefill's.
  logits, ref_state = api.prefill(ref_model, np.asarray(prompt, np.int32))
  assert first.token_id == int(np.argmax(np.asarray(logits[0, -1])))
  lp = logprobs.from_proto(first.logprob, config.vocab_size, 3)
  cmp = logprob_check.compare([lp], logprob_check.reference_logprobs(ref_model, prompt,
                                                                     [first.token_id]))
  assert cmp.ok, cmp
  # The state restored from the two processes' shards steps like the reference
  # state, and passes the pod's own logit probe; a damaged one does not.
  state = arrivals.states["rpc-1"]
  want = logit_probe.probe_logits(ref_model, ref_state, first.token_id)
  got = logit_probe.probe_logits(ref_model, state, first.token_id)
  np.testing.assert_allclose(got, want, atol=logprob_check.LOGPROB_ATOL)
  probe = logit_probe.LogitProbe(first.probe.token, tuple(first.probe.ids),
                                 tuple(first.probe.values), first.probe.dtype)
  assert logit_probe.check_state(ref_model, state, probe).ok
  broken = sensitivity.damage(state, config.layer_kinds)
  assert not logit_probe.check_state(ref_model, broken, probe).ok
  # Shard to shard: each pod process sent its own part.
  sent = [gauges[f"pod_bytes_sent:{p}"] for p in (0, 1)]
  assert 0 < sent[1] < sent[0], sent
  # The link gauges the broker's live view reads count every process's bytes.
  assert gauges["link_bytes_sent_total"] == done.bytes_sent == sum(sent)
  assert gauges["egress_bytes:default"] == done.bytes_sent
