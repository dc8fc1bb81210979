"""A prefill pod and a decode slice placed by Ray on region-labelled nodes.

All slow (the default suite's gang-scheduling check is in test_ray_launch.py,
on its Ray cluster): a P=2 (TP=4)
pod on the region_a node streams shard to shard into a TP=2 slice on the
region_b node, token-exact; a pod process lost mid-prefill fails the request
with UNAVAILABLE.
"""

from __future__ import annotations

import grpc
import pytest

from paas_jax.serving import pod_launch
from paas_jax.serving.pod_ray import run_ray
from paas_jax.serving.pod_worker import FAULT_EXIT

from tests.serving.ray_nodes import labelled_ray_cluster
from tests.serving.test_pod import _check_pod_run, pod_config

PROMPT = [11, 200, 3, 45, 99, 7, 128, 64, 5]


@pytest.fixture(scope="module")
def ray_nodes():
  with labelled_ray_cluster() as (_, nodes):  # region_a: 2 CPUs, region_b: 4
    yield nodes


@pytest.mark.slow
def test_pod_on_region_a_node_to_slice_on_region_b_node(ray_nodes):
  config = pod_config("tiny_gdn_gqa")
  run = run_ray(config, PROMPT, pod_processes=2, pod_devices=2, slice_processes=1,
                slice_devices=2, max_new_tokens=4, timeout_s=300)
  _check_pod_run(run, config, PROMPT, 4)
  assert {r["node_id"] for r in run.prefill} == {ray_nodes["a"]}
  assert {r["node_id"] for r in run.decode} == {ray_nodes["b"]}


@pytest.mark.slow
def test_a_pod_process_lost_on_ray_fails_the_request_cleanly(ray_nodes):
  del ray_nodes
  with pytest.raises(pod_launch.PodFailure) as e:
    run_ray(pod_config("tiny_gdn_gqa"), PROMPT, pod_processes=2, pod_devices=2,
            slice_processes=1, slice_devices=2, max_new_tokens=4, timeout_s=300,
            fault={"process": 1, "at": "prefill"})
  assert e.value.code == grpc.StatusCode.UNAVAILABLE
  assert (e.value.process, e.value.returncode) == ("prefill1", FAULT_EXIT)
  assert not [p for p in e.value.finished if p.startswith("decode")]
