"""A decode server's intake of pod transfers (``pod_intake``), over a real
StateReceiver and gRPC: a TP=2 state held by two pod processes (one device
each) arrives as two shard-to-shard transfers and is restored only once both
parts are there and match the merged manifest; a missing part, an incomplete
part or a failed part restores nothing (default suite, a few seconds)."""

from __future__ import annotations

import dataclasses

import grpc
import jax
import numpy as np
import pytest

from paas_jax import codec
from paas_jax.codec import shard_plan as sp
from paas_jax.models import load_config
from paas_jax.serving import launch_args, pod, pod_supervisor, pod_transfer
from paas_jax.serving.launch import ClusterSpec
from paas_jax.serving.pod_intake import PodIntake
from paas_jax.transport.receiver import ReceiverOptions, StateReceiver
from paas_jax.transport.receiver_server import serve_receiver
from paas_jax.transport.sender import SenderOptions, StateSender

TOKENS = 64


class _Verifier:
  def __init__(self):
    self.arrived, self.forgotten = {}, []

  def state_arrived(self, rid, state, info, lossy=False):
    self.arrived[rid] = (state, info)

  def forget(self, rid):
    self.forgotten.append(rid)


@pytest.fixture()
def decode_side():
  config = load_config("tiny_gdn_gqa")
  verifier, failed = _Verifier(), []
  intake = PodIntake(config, verifier=verifier, fail=lambda *a: failed.append(a))
  receiver = StateReceiver(models={config.name: config.fingerprint()},
                           template=intake.template, on_ready=intake.on_state,
                           on_failure=intake.on_failure,
                           options=ReceiverOptions(transfer_timeout_s=30, idle_timeout_s=30))
  server = serve_receiver(receiver, "127.0.0.1:0")
  yield config, intake, verifier, failed, server.target
  server.stop(grace=None)


def _pod_state(config):
  """A TP=2 state as a pod of two processes (device i = process i) holds it,
  encoded, with the plan to a single decode process."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
  state = pod.synthetic_state(config, mesh, TOKENS, seed=3)
  groups = list(codec.encode_groups(state, token_count=TOKENS))
  manifest = pod_transfer.partial_manifest(
      groups, model_id=config.name, config_fingerprint=config.fingerprint(),
      token_count=TOKENS, batch=1, options=codec.CodecOptions())
  source = sp.placement_from_state(state)
  source = dataclasses.replace(source, mesh=dataclasses.replace(source.mesh,
                                                                device_processes=(0, 1)))
  target = pod.state_placement(config, sp.MeshSpec(("tp",), (1,), (0,)))
  manifest = dataclasses.replace(manifest, placements={"source": source.to_dict(),
                                                       "target": target.to_dict()})
  plan = sp.plan_transfer(manifest, source, target)
  return state, groups, plan, pod_transfer.Envelope(manifest, 5, 2)


def _send(config, groups, plan, envelope, source, address, rid):
  return pod_transfer.send_shards(groups, plan, envelope, source=source, targets=[address],
                                  request_id=rid, model_id=config.name,
                                  config_fingerprint=config.fingerprint())


def test_both_parts_restore_the_state_exactly(decode_side):
  config, intake, verifier, failed, address = decode_side
  state, groups, plan, envelope = _pod_state(config)
  sent = [_send(config, groups, plan, envelope, s, address, "r1")[0] for s in (0, 1)]
  # Each process sent only what it holds: process 1 half of the split heads.
  assert all(s.planned_bytes > 0 for s in sent) and sent[1].planned_bytes < sent[0].planned_bytes
  assert not set(sent[0].keys) & set(sent[1].keys)
  got, info = verifier.arrived["r1"]
  assert info["pod_processes"] == 2 and not failed and intake.pending() == 0
  want = dict(codec.layout.named_leaves(jax.device_get(state)))
  for name, leaf in codec.layout.named_leaves(got):
    np.testing.assert_array_equal(np.asarray(leaf), want[name], err_msg=name)


def test_one_part_alone_restores_nothing(decode_side):
  config, intake, verifier, failed, address = decode_side
  _, groups, plan, envelope = _pod_state(config)
  _send(config, groups, plan, envelope, 0, address, "r2")
  assert "r2" not in verifier.arrived and intake.pending() == 1 and not failed


def test_a_part_missing_an_object_is_refused(decode_side):
  config, intake, verifier, failed, address = decode_side
  _, groups, plan, envelope = _pod_state(config)
  dropped = next(r.key for r in plan.routes if r.source == 1)
  short = dataclasses.replace(plan, routes=tuple(r for r in plan.routes if r.key != dropped))
  _send(config, groups, plan, envelope, 0, address, "r3")
  _send(config, groups, short, envelope, 1, address, "r3")  # a consistent, short transfer
  assert "r3" not in verifier.arrived and intake.refused == 1
  assert failed and failed[0][0] == "r3" and failed[0][1] == grpc.StatusCode.DATA_LOSS
  assert dropped in failed[0][2]


def test_a_failed_part_drops_the_other_and_fails_the_request(decode_side):
  config, intake, verifier, failed, address = decode_side
  _, groups, plan, envelope = _pod_state(config)
  _send(config, groups, plan, envelope, 0, address, "r4")
  with StateSender(address, options=SenderOptions(rpc_timeout_s=30)) as sender:
    tx = sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                      num_layers=config.n_layers, token_count=TOKENS, batch=1,
                      codec=codec.CodecOptions(),
                      transfer_id=pod_transfer.transfer_id("r4", 1, 0))
    tx.abort("pod process 1 lost")
  assert "r4" not in verifier.arrived and intake.pending() == 0
  assert failed and failed[0][0] == "r4" and "pod process 1" in failed[0][2]


def test_drop_releases_a_cancelled_requests_parts(decode_side):
  config, intake, verifier, failed, address = decode_side
  _, groups, plan, envelope = _pod_state(config)
  _send(config, groups, plan, envelope, 0, address, "r5")
  assert intake.pending() == 1
  assert intake.drop("r5") and not intake.drop("r5") and intake.pending() == 0
  _send(config, groups, plan, envelope, 1, address, "r5")  # the other part, too late
  assert "r5" not in verifier.arrived and not failed


@pytest.mark.parametrize("rid", ["r1", "a:b", "x->y", "pod:7"])
def test_pod_transfer_ids_round_trip(rid):
  assert pod_transfer.parse_transfer_id(pod_transfer.transfer_id(rid, 3, 0)) == (rid, 3, 0)
  assert pod_transfer.is_pod_transfer(pod_transfer.transfer_id(rid, 0, 1))


@pytest.mark.parametrize("tid", ["r1", "seg:1:0:64:r1", "pod:r1", "pod:r1:a->0", "pod:r1:0->"])
def test_other_transfer_ids_are_not_pod_parts(tid):
  with pytest.raises(sp.ShardPlanError):
    pod_transfer.parse_transfer_id(tid)


def test_the_supervisor_sets_each_processs_own_flags():
  args = launch_args.prefill_args(ClusterSpec(prefill_pod=2, prefill_pod_fault="1:prefill"),
                                  "127.0.0.1")
  assert args[:2] == ["-m", "paas_jax.serving.pod_prefill_server"]
  assert "--pod_processes=2" in args and "--pod_fault=1:prefill" in args
  single = launch_args.prefill_args(ClusterSpec(), "127.0.0.1")
  assert single[1] == "paas_jax.serving.prefill_server" and not any(
      a.startswith("--pod_") for a in single)
  kept = pod_supervisor.passed_on(args + ["--ready_file=x", "--pod_process_id=1"])
  assert not any(a.split("=")[0] in ("--port", "--transfer_port", "--ready_file", "--pod_fault",
                                     "--pod_process_id") for a in kept)
  assert "--pod_processes=2" in kept and "--config=tiny_gdn_gqa" in kept
