"""Regions as multi-process JAX programs: state placement, shard-to-shard
transfer checks (in one process), and real pods and slices of processes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paas_jax import codec
from paas_jax.codec import shard_plan as sp
from paas_jax.codec.errors import IncompleteStateError
from paas_jax.models import api, load_config
from paas_jax.state import abstract_state
from paas_jax.serving import pod, pod_launch, pod_transfer
from tests.codec.test_sharded import make_state, shardings_for


def pod_config(name: str):
  """A tiny model whose heads split 4 ways, with an untied output head (a tied
  head on these random weights echoes the last token, which would make
  token-exactness say nothing about the transferred state)."""
  config = load_config(name)
  changes = {"tie_embeddings": False}
  if config.attention is not None and config.attention.n_heads % 4 == 0:
    changes["attention"] = dataclasses.replace(config.attention, n_kv_heads=4)
  return dataclasses.replace(config, **changes)


def test_state_partition_specs_split_heads_where_the_mesh_divides_them():
  config = load_config("tiny_gdn_gqa")  # GGGA, 2 KV heads, 4 value heads
  specs = pod.state_partition_specs(config, 2)
  assert specs["layers/3/k"] == (None, None, "tp", None)
  assert specs["layers/0/recurrent"] == (None, "tp", None, None)
  assert specs["layers/0/conv"] == () and specs["lengths"] == ()
  specs4 = pod.state_partition_specs(config, 4)
  assert specs4["layers/3/k"] == ()                      # 2 KV heads: replicated
  assert specs4["layers/0/recurrent"] == (None, "tp", None, None)
  assert pod.state_partition_specs(config, 1)["layers/0/recurrent"] == ()
  for name in ("tiny_mamba2_gqa", "tiny_kda_mla", "tiny_swa_gqa"):
    cfg = pod_config(name)
    specs = pod.state_partition_specs(cfg, 4)
    assert any(s for s in specs.values()), name
    mesh = sp.MeshSpec(("tp",), (4,), (0, 0, 1, 1))
    for leaf_name, leaf in codec.layout.named_leaves(abstract_state(cfg, 1, 16)):
      sp.device_boxes(mesh, specs[leaf_name], leaf.shape)  # Every spec divides its axis.


def _pod_of_two():
  """A TP=8 state as two pod processes (4 devices each) would hold it, encoded,
  with the plan to a TP=2 slice of two processes."""
  devices = jax.devices()
  state = make_state(jax.sharding.Mesh(np.array(devices[:8]), ("tp",)))
  groups = list(codec.encode_groups(state))
  manifest = pod_transfer.partial_manifest(groups, model_id="m", config_fingerprint="f",
                                           token_count=100, batch=1,
                                           options=codec.CodecOptions())
  source = sp.placement_from_state(state)
  source = dataclasses.replace(source, mesh=dataclasses.replace(
      source.mesh, device_processes=(0,) * 4 + (1,) * 4))
  target_mesh = jax.sharding.Mesh(np.array(devices[:2]), ("tp",))
  like = jax.eval_shape(lambda: state)
  named = dict(codec.layout.named_leaves(like))
  target = sp.StatePlacement(sp.MeshSpec(("tp",), (2,), (0, 1)), {
      n: tuple(shardings_for(target_mesh)(n, leaf).spec) for n, leaf in named.items()})
  manifest = dataclasses.replace(manifest, placements={"source": source.to_dict(),
                                                       "target": target.to_dict()})
  plan = sp.plan_transfer(manifest, source, target)
  envelope = pod_transfer.Envelope(manifest, first_token=7, source_processes=2)
  return state, groups, plan, envelope, target, target_mesh, like


def _collect_in_process(groups, plan, envelope, target, drop=()):
  """What slice process ``target`` would hold after both pod processes sent
  ``routed_groups`` to it (without gRPC)."""
  store = codec.MemoryStore()
  received = {}
  for source in (0, 1):
    for g in pod_transfer.routed_groups(groups, plan, source, target, envelope):
      for array, chunk in g.entry.chunks():
        if array.name != pod_transfer.ENVELOPE and chunk.key not in drop:
          received[chunk.key] = chunk
          store.put_many({chunk.key: g.blobs[chunk.key]})
  return pod_transfer.Collected(envelope, store, received, wire_bytes=0)


def test_routed_groups_restore_each_slice_process_exactly():
  state, groups, plan, envelope, target, target_mesh, like = _pod_of_two()
  assert pod_transfer.Envelope.from_array(envelope.to_array()) == envelope
  ref = {n: np.asarray(x.astype(jnp.float32)) for n, x in codec.layout.named_leaves(state)}
  for t in (0, 1):
    collected = _collect_in_process(groups, plan, envelope, t)
    assert set(collected.received) == plan.keys_to(t)
    restored = pod_transfer.restore(collected, t, target, like, shardings_for(target_mesh))
    for name, leaf in codec.layout.named_leaves(restored):
      shard = leaf.addressable_shards[t]  # Device t of the slice is process t's.
      want = ref[name][shard.index]
      if name.startswith("layers/0/"):
        want = want.copy()
        want[:, 100:] = 0
      np.testing.assert_array_equal(np.asarray(shard.data.astype(jnp.float32)), want)


def test_slice_refuses_a_missing_or_altered_object_or_another_placement():
  _, groups, plan, envelope, target, _, _ = _pod_of_two()
  key = next(iter(sorted(k for k in plan.keys_to(1) if "/c/" in k)))
  short = _collect_in_process(groups, plan, envelope, 1, drop={key})
  with pytest.raises(IncompleteStateError, match="missing"):
    pod_transfer.verify_collected(short, 1, target)
  altered = _collect_in_process(groups, plan, envelope, 1)
  altered.received[key] = dataclasses.replace(altered.received[key], crc32c=1)
  with pytest.raises(IncompleteStateError, match="differing"):
    pod_transfer.verify_collected(altered, 1, target)
  other = dataclasses.replace(target, mesh=sp.MeshSpec(("tp",), (2,), (0, 0)))
  with pytest.raises(sp.ShardPlanError, match="planned for target placement"):
    pod_transfer.verify_collected(_collect_in_process(groups, plan, envelope, 1), 1, other)
  # A pod process never sends what it does not hold.
  mine = [dataclasses.replace(g, blobs={k: v for k, v in g.blobs.items() if "/c/0/0/7/" not in k})
          for g in groups]
  with pytest.raises(sp.ShardPlanError, match="does not hold"):
    pod_transfer.routed_groups(mine, plan, 1, 1, envelope)


def _check_pod_run(run, config, prompt, max_new):
  reference = api.generate(api.Model.create(config, 0), prompt, max_new).tokens
  for r in run.decode:
    assert r["tokens"] == reference, (r["process"], r["tokens"], reference)
  assert {r["first_token"] for r in run.prefill} == {reference[0]}
  # Shard to shard: each pod process encodes and sends only its own chunks,
  # the two sets are disjoint and together they are the whole state.
  encoded = [set(r["encoded_keys"]) for r in run.prefill]
  for r, mine in zip(run.prefill, encoded):
    for s in r["sent"]:
      data = {k for k in s["keys"] if not k.endswith("zarr.json")}
      assert data <= mine, (r["process"], sorted(data - mine)[:4])
      assert s["wire_bytes"] >= s["planned_bytes"]
    # A pod process may send a slice process nothing but metadata (its heads
    # live elsewhere in the slice), but every pod process sends something.
    assert sum(s["planned_bytes"] for s in r["sent"]) > 0, r["process"]
  if len(encoded) > 1:
    assert not set.intersection(*encoded)
    assert all(0 < r["encoded_bytes"] < r["state_bytes"] for r in run.prefill)
  received = set().union(*(set(r["received_keys"]) for r in run.decode))
  assert received == set().union(*encoded)
  return reference


def test_pod_of_two_processes_to_a_tp2_slice(tmp_path):
  """P=2 prefill processes (2 devices each, TP=4) -> a TP=2 slice (this process)."""
  config = pod_config("tiny_gdn_gqa")
  prompt = [11, 200, 3, 45, 99, 7, 128, 64, 5]
  run = pod_launch.run_local(config, prompt, pod_processes=2, pod_devices=2,
                             slice_processes=1, slice_devices=2, max_new_tokens=4,
                             workdir=tmp_path, timeout_s=300,
                             in_process_devices=jax.devices()[:2])
  _check_pod_run(run, config, prompt, 4)
  # Both pod processes sent to the one slice process, about half each.
  sent = [r["sent"][0]["planned_bytes"] for r in run.prefill]
  assert all(s > 0 for s in sent)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_gdn_gqa", "tiny_swa_gqa", "tiny_mamba2_gqa",
                                  "tiny_kda_mla", "tiny_dense_gqa"])
@pytest.mark.parametrize("pod_processes,pod_devices,slice_processes,slice_devices", [
    (2, 2, 2, 1),   # TP=4 over 2 processes -> TP=2 over 2 processes
    (2, 2, 1, 1),   # -> TP=1
    (1, 2, 2, 1),   # P=1 -> Q=2
])
def test_pods_and_slices_every_layer_kind(tmp_path, name, pod_processes, pod_devices,
                                          slice_processes, slice_devices):
  config = pod_config(name)
  prompt = [11, 200, 3, 45, 99, 7, 128, 64, 5, 17, 33]
  run = pod_launch.run_local(config, prompt, pod_processes=pod_processes,
                             pod_devices=pod_devices, slice_processes=slice_processes,
                             slice_devices=slice_devices, max_new_tokens=5,
                             workdir=tmp_path, timeout_s=600)
  _check_pod_run(run, config, prompt, 5)
  assert len(run.decode) == slice_processes
