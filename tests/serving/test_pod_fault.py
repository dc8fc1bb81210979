"""A pod process dies mid-request (serving/pod_launch.run_supervised; real processes).

The request's attempt fails with UNAVAILABLE (the process's exit, not the
deadline: no hang), every process of the pod and slice is stopped, no slice
process restores or decodes anything from the broken pod, and the pod restarts
as a unit and prefills the request again, token-exact.
"""

from __future__ import annotations

import grpc
import pytest

from paas_jax.models import api
from paas_jax.serving import pod_launch
from paas_jax.serving.pod_worker import FAULT_EXIT

from tests.serving.test_pod import pod_config

PROMPT = [11, 200, 3, 45, 99, 7, 128, 64, 5]
POD = dict(pod_processes=2, pod_devices=2, slice_processes=1, slice_devices=2,
           max_new_tokens=4, timeout_s=300)


@pytest.mark.slow  # ~60 s under load: three processes start JAX and build the model
def test_a_pod_process_lost_mid_prefill_fails_the_attempt_cleanly(tmp_path):
  config = pod_config("tiny_gdn_gqa")
  with pytest.raises(pod_launch.PodFailure) as e:
    pod_launch.run_supervised(config, PROMPT, workdir=tmp_path, max_pod_restarts=0,
                              fault={"process": 1, "at": "prefill"}, **POD)
  failure = e.value
  # The lost process's own exit status, long before the 300 s deadline.
  assert failure.code == grpc.StatusCode.UNAVAILABLE
  assert (failure.process, failure.returncode) == ("prefill1", FAULT_EXIT)
  # Nothing reached decode: no slice process finished (restored or decoded).
  assert not [p for p in failure.finished if p.startswith("decode")]


@pytest.mark.slow
@pytest.mark.parametrize("process,at", [(1, "prefill"), (0, "transfer")])
def test_the_pod_restarts_as_a_unit_and_the_request_is_prefilled_again(tmp_path, process, at):
  config = pod_config("tiny_gdn_gqa")
  run = pod_launch.run_supervised(config, PROMPT, workdir=tmp_path, max_pod_restarts=1,
                                  fault={"process": process, "at": at}, **POD)
  (attempt,) = run.attempts
  assert (attempt.code, attempt.process, attempt.returncode) == (
      "UNAVAILABLE", f"prefill{process}", FAULT_EXIT)
  assert not [p for p in attempt.finished if p.startswith("decode")]
  reference = api.generate(api.Model.create(config, 0), PROMPT, 4).tokens
  assert [r["tokens"] for r in run.decode] == [reference]
  # The second incarnation is a whole new pod: both processes ran again.
  assert sorted(r["process"] for r in run.prefill) == [0, 1]
  assert (tmp_path / "pod1" / "prefill0.log").exists()
  assert (tmp_path / "pod1" / "prefill1.log").exists()
