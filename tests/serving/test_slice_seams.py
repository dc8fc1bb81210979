"""The seams a decode slice adds, on their own (no JAX program, no servers):
the broker's view of a slice (``DecodeTarget.parse`` / ``with_slice``), the
pod's validation of ``PrefillRequest.decode_slice`` and its target mesh, the
launcher's and the supervisor's handling of a slice, and ``SliceJob`` /
``SliceParts`` bookkeeping. Each check has its failing case beside it."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from paas_jax.proto import serving_pb2
from paas_jax.serving import launch_args, pd_roles, pod_supervisor
from paas_jax.serving.launch import ClusterSpec
from paas_jax.serving.node_pool import DecodeTarget
from paas_jax.serving.pod_prefill import PodJob
from paas_jax.serving.pod_prefill_server import decode_slice_of
from paas_jax.serving.slice_batch import SliceRound
from paas_jax.serving.slice_decode import SliceJob, SliceParts, SliceReceiveError
from paas_jax.serving.validation import InvalidRequestError, RequestParams
from paas_jax.models.api import SamplingParams
from paas_jax.state.logit_probe import LogitProbe


def _announced(*targets, devices=1):
  return serving_pb2.DecodeSlice(transfer_targets=list(targets), devices_per_process=devices)


def test_a_slice_is_dialled_where_the_broker_says_or_where_it_announces():
  own = _announced("b:1", "b:2", devices=2)
  single = DecodeTarget.parse("c:0", "relay:1").with_slice(own)
  assert single.slice == ("relay:1", "b:2") and single.slice_devices == 2
  assert single.decode_slice == _announced("relay:1", "b:2", devices=2)
  listed = DecodeTarget.parse("c:0", "r:1+r:2").with_slice(own)
  assert listed.transfer == "r:1" and listed.slice == ("r:1", "r:2")
  plain = DecodeTarget.parse("c:0", "d:1")
  assert plain.with_slice(serving_pb2.DecodeSlice()) == plain and plain.decode_slice is None


@pytest.mark.parametrize("entry,announced,match", [
    ("r:1+r:2+r:3", _announced("b:1", "b:2"), "slice of 2 processes"),
    ("r:1+r:2", serving_pb2.DecodeSlice(), "is one process"),
    ("r:1+r:2", _announced("b:1", "b:2", devices=0), "devices per process"),
])
def test_a_slice_the_broker_and_the_node_disagree_on_is_refused(entry, announced, match):
  with pytest.raises(ValueError, match=match):
    DecodeTarget.parse("c:0", entry).with_slice(announced)
  with pytest.raises(ValueError, match="empty address"):
    DecodeTarget.parse("c:0", "r:1+")


def _prefill_request(**slice_fields):
  req = serving_pb2.PrefillRequest(request_id="r", decode_target="s:0")
  if slice_fields:
    req.decode_slice.CopyFrom(serving_pb2.DecodeSlice(**slice_fields))
  return req


def test_the_pod_takes_a_decode_slice_and_plans_for_its_mesh():
  assert decode_slice_of(_prefill_request()) == ((), 0)
  targets, devices = decode_slice_of(_prefill_request(transfer_targets=["s:0", "s:1"],
                                                      devices_per_process=2))
  assert targets == ("s:0", "s:1") and devices == 2
  job = PodJob(1, "r", (1, 2), "s:0", slice_targets=targets, slice_devices=devices)
  assert job.targets == ["s:0", "s:1"]
  assert job.target_mesh.axis_sizes == (4,) and job.target_mesh.device_processes == (0, 0, 1, 1)
  assert PodJob.from_json(job.to_json()) == job
  one = PodJob(1, "r", (1, 2), "d:0")
  assert one.targets == ["d:0"] and one.target_mesh.device_processes == (0,)


@pytest.mark.parametrize("fields,match", [
    ({"transfer_targets": ["s:0", ""], "devices_per_process": 1}, "non-empty"),
    ({"transfer_targets": ["s:0"], "devices_per_process": 0}, "devices_per_process"),
    ({"transfer_targets": ["other:0", "s:1"], "devices_per_process": 1}, "process 0"),
])
def test_a_malformed_decode_slice_is_invalid(fields, match):
  with pytest.raises(InvalidRequestError, match=match):
    decode_slice_of(_prefill_request(**fields))


def test_the_launcher_starts_a_slice_only_where_it_fits():
  spec = ClusterSpec(prefill_pod=2, decode_slice=2, decode_slice_devices=2)
  launch_args.check_decode_slice(spec)
  args = launch_args.decode_args(spec, "127.0.0.1", None)
  assert args[:2] == ["-m", "paas_jax.serving.slice_decode_server"]
  assert "--slice_processes=2" in args and "--slice_devices=2" in args
  assert launch_args.decode_args(ClusterSpec(), "127.0.0.1", None)[1] == (
      "paas_jax.serving.decode_server")
  # Region A of one process feeds a slice as a pod of one (the slice takes a pod's parts).
  one = ClusterSpec(decode_slice=2, prefix_block=0)
  launch_args.check_decode_slice(one)
  args = launch_args.prefill_args(one, "127.0.0.1")
  assert args[1] == "paas_jax.serving.pod_prefill_server" and "--pod_processes=1" in args
  assert launch_args.prefill_args(ClusterSpec(), "127.0.0.1")[1] == (
      "paas_jax.serving.prefill_server")
  with pytest.raises(ValueError, match="prefill_faults"):
    launch_args.check_decode_slice(dataclasses.replace(one, prefill_faults="corrupt_chunks=3"))
  # Several decode regions each run their slices, and a flaky WAN fronts every
  # slice process (test_slice_serving, slow).
  launch_args.check_decode_slice(ClusterSpec(prefill_pod=2, decode_slice=2, decode_regions=2))
  launch_args.check_decode_slice(ClusterSpec(prefill_pod=2, decode_slice=2, flaky_wan=True))
  # A slice keeps a prefix cache for its local prefills (slice_prefix): the flag
  # reaches every slice process.
  cached = ClusterSpec(prefill_pod=2, decode_slice=2, prefix_block=32)
  launch_args.check_decode_slice(cached)
  assert "--prefix_block=32" in launch_args.decode_args(cached, "127.0.0.1", None)


def test_a_slice_among_several_pd_nodes_is_node_0_and_the_others_single_processes():
  spec = ClusterSpec(prefill_pod=2, decode_slice=2, pd_nodes=3)
  launch_args.check_decode_slice(spec)
  assert launch_args.pd_node_shapes(spec) == [pd_roles.SLICE, pd_roles.SINGLE, pd_roles.SINGLE]
  modules = [launch_args.decode_args(spec, "127.0.0.1", None, node)[1] for node in range(3)]
  assert modules == ["paas_jax.serving.slice_decode_server", "paas_jax.serving.decode_server",
                     "paas_jax.serving.decode_server"]
  # The single nodes take a decode server's flags, none of a slice's.
  plain = launch_args.decode_args(spec, "127.0.0.1", None, 1)
  assert not any(a.startswith("--slice_") for a in plain) and "--n_slots=8" in plain
  # pd_prefill_nodes splits the nodes beside the slice and must leave a
  # single-process PD-D node among them (the slice takes no PD-P state).
  launch_args.check_decode_slice(dataclasses.replace(spec, pd_prefill_nodes=1))
  with pytest.raises(ValueError, match="pd_prefill_nodes=2"):
    launch_args.check_decode_slice(dataclasses.replace(spec, pd_prefill_nodes=2))
  # Without a slice every node is a single process.
  assert launch_args.pd_node_shapes(ClusterSpec(pd_nodes=2)) == [pd_roles.SINGLE] * 2


def test_the_supervisor_gives_every_slice_process_its_own_flags():
  region = pod_supervisor.RegionProcesses(module="paas_jax.serving.slice_decode_server",
                                          kind="slice", processes=2, own_transfer_ports=True)
  argv = ["--slice_processes=2", "--transfer_port=7", "--slice_process_id=1",
          "--slice_coordinator=x:1", "--port=3", "--config=tiny_gdn_gqa"]
  assert pod_supervisor.passed_on(argv, region) == ["--slice_processes=2",
                                                    "--config=tiny_gdn_gqa"]
  # The pod's own flags are not the slice's: a pod keeps --slice_* flags it is given.
  assert "--slice_process_id=1" in pod_supervisor.passed_on(argv)
  # With its own data planes, each process's data-plane port is the supervisor's too.
  tcp = dataclasses.replace(region, own_data_plane_ports=True)
  assert pod_supervisor.passed_on(argv + ["--data_plane_port=9"], tcp) == [
      "--slice_processes=2", "--config=tiny_gdn_gqa"]
  assert "--data_plane_port=9" in pod_supervisor.passed_on(argv + ["--data_plane_port=9"],
                                                           region)
  # The ports a restarted supervisor is given are its own, never a process's.
  pinned = ["--slice_transfer_ports=41", "--slice_data_plane_ports=42,43"]
  assert pod_supervisor.passed_on(argv + pinned, tcp) == ["--slice_processes=2",
                                                           "--config=tiny_gdn_gqa"]


def test_the_launcher_relays_every_slice_processs_data_plane():
  spec = ClusterSpec(prefill_pod=2, decode_slice=2, prefix_block=0, transfer_plane="tcp")
  args = launch_args.decode_args(spec, "127.0.0.2", "127.0.0.3")
  assert "--transfer_plane=tcp" in args and "--data_plane_host=127.0.0.3" in args
  assert "--data_plane_host=127.0.0.3" not in launch_args.decode_args(spec, "127.0.0.2", None)


def test_a_slice_job_round_trips_with_its_probe_and_sampling():
  params = RequestParams(sampling=SamplingParams(0.7, 5, 0.9), seed=3, max_new_tokens=9,
                         stop_tokens=(4, 8), logprobs=2)
  probe = LogitProbe(11, (3, 1), (2.5, 1.25), "float32")
  job = SliceJob.from_request(4, "r", 33, params, first_token=11, probe=probe)
  back = SliceJob.from_json(job.to_json())
  assert back == job and back.remote and back.params == params and back.logit_probe == probe
  local = SliceJob.from_request(5, "l", 3, params, prompt=(1, 2, 3))
  assert not local.remote and local.logit_probe is None


def test_slice_parts_fail_a_job_with_its_transfers_status_and_honour_a_cancel():
  parts = SliceParts(1)
  parts.on_failure("pod:r1:0->1", grpc.StatusCode.DATA_LOSS, "crc mismatch")
  with pytest.raises(SliceReceiveError) as e:
    parts.take("r1", 5)
  assert e.value.code == "DATA_LOSS" and "pod process 0 to slice process 1" in e.value.message
  with pytest.raises(SliceReceiveError) as e:
    parts.take("r2", 5, cancelled=lambda: True)
  assert e.value.code == "CANCELLED"
  with pytest.raises(SliceReceiveError) as e:
    parts.take("r3", 0.05)
  assert e.value.code == "DEADLINE_EXCEEDED" and parts.pending() == 0


def test_a_slice_round_round_trips_with_its_jobs():
  job = SliceJob.from_request(4, "r/1", 33, RequestParams(max_new_tokens=3), first_token=11)
  rnd = SliceRound(7, ((2, job),), evict=("a",), drop=("b", "c"), steps=4)
  assert SliceRound.from_json(rnd.to_json()) == rnd


def test_slice_parts_announce_complete_failed_and_gone():
  heard = []
  parts = SliceParts(1, on_status=lambda rid, verdict: heard.append((rid, verdict)))
  parts.on_failure("pod:r1:0->1", grpc.StatusCode.DATA_LOSS, "crc mismatch")
  assert heard[-1][0] == "r1" and heard[-1][1]["code"] == "DATA_LOSS"
  parts.drop("r1")  # the failure goes with the request
  assert heard[-1] == ("r1", None)
  with pytest.raises(SliceReceiveError) as e:
    parts.take("r1", 0.05)
  assert e.value.code == "DEADLINE_EXCEEDED" and heard[-1] == ("r1", None)
