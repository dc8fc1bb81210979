"""Shard-to-shard transfer plans (pure), checked against JAX's own placement and
against real encodes and restores on the 8 fake CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paas_jax import codec
from paas_jax.codec import shard_plan as sp
from tests.codec.test_sharded import make_state, shardings_for


def _mesh(shape, names=("tp",)):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _box(index, shape):
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@pytest.mark.parametrize("mesh_shape,names,spec,shape", [
    ((8,), ("tp",), (None, None, "tp", None), (1, 256, 8, 16)),
    ((4,), ("tp",), (None, "tp"), (2, 12)),
    ((2, 4), ("dp", "tp"), ("dp", None, "tp"), (2, 6, 8)),
    ((2, 4), ("dp", "tp"), (("dp", "tp"), None), (16, 3)),
    ((2, 2), ("dp", "tp"), (None, "tp"), (4, 4)),      # replicated over dp
    ((4,), ("tp",), (), (5,)),                         # fully replicated
])
def test_device_boxes_match_named_sharding(mesh_shape, names, spec, shape):
  mesh = _mesh(mesh_shape, names)
  sharding = NamedSharding(mesh, P(*spec))
  spec_mesh = sp.MeshSpec.from_mesh(mesh)
  expected = sharding.devices_indices_map(shape)
  got = sp.device_boxes(spec_mesh, spec, shape)
  assert got == [_box(expected[d], shape) for d in mesh.devices.flat]
  # The writer of each box is the device JAX gives replica_id 0, which is what
  # the encoder writes.
  x = jax.device_put(jnp.zeros(shape), sharding)
  owners = {_box(s.index, shape): s.device for s in x.addressable_shards if s.replica_id == 0}
  flat = list(mesh.devices.flat)
  firsts = {}
  for box, d in zip(got, flat):
    firsts.setdefault(box, d)
  assert firsts == owners


def test_mesh_spec_rejects_wrong_device_count_and_unknown_axis():
  with pytest.raises(sp.ShardPlanError, match="needs 4 devices"):
    sp.MeshSpec(("tp",), (4,), (0, 0, 1))
  with pytest.raises(sp.ShardPlanError, match="mesh axis 'dp'"):
    sp.device_boxes(sp.MeshSpec(("tp",), (2,), (0, 1)), ("dp",), (4,))
  with pytest.raises(sp.ShardPlanError, match="evenly"):
    sp.device_boxes(sp.MeshSpec(("tp",), (4,), (0, 0, 1, 1)), (None, "tp"), (2, 10))


def _encode(state, options=codec.CodecOptions()):
  groups = list(codec.encode_groups(state, options=options))
  manifest = codec.build_manifest([g.entry for g in groups], model_id="m",
                                  config_fingerprint="f", token_count=100, batch=1,
                                  options=options)
  blobs = {k: v for g in groups for k, v in g.blobs.items()}
  return manifest, blobs


def _placement(state, device_processes):
  placement = sp.placement_from_state(state)
  return dataclasses.replace(placement, mesh=dataclasses.replace(
      placement.mesh, device_processes=tuple(device_processes)))


def _restore_process(plan, manifest, blobs, like, mesh, process):
  """What target process ``process`` restores from only the objects routed to it:
  name -> {box: host data} for the boxes its devices hold."""
  store = codec.MemoryStore()
  store.put_many({k: blobs[k] for k in plan.keys_to(process)})
  state = codec.restore_from_store(store, manifest, like, shardings_for(mesh))
  out = {}
  for name, leaf in codec.layout.named_leaves(state):
    for shard, proc in zip(_shards_in_mesh_order(leaf, mesh), plan.target.mesh.device_processes):
      if proc == process:
        out.setdefault(name, {})[_box(shard.index, leaf.shape)] = np.asarray(
            shard.data.astype(jnp.float32))
  return out


def _shards_in_mesh_order(leaf, mesh):
  by_device = {s.device: s for s in leaf.addressable_shards}
  return [by_device[d] for d in mesh.devices.flat]


@pytest.mark.parametrize("target_procs", [(0, 0), (0, 1)])
def test_pod_of_two_to_tp2(target_procs):
  # Source: TP=8 over 2 processes (4 devices each); target: TP=2 over one
  # process, or over two (one device each).
  state = make_state(_mesh((8,)))
  manifest, blobs = _encode(state)
  source = _placement(state, [0] * 4 + [1] * 4)
  target_mesh = _mesh((2,))
  like = jax.eval_shape(lambda: state)
  target_state = codec.restore_from_store(_store(blobs), manifest, like,
                                          shardings_for(target_mesh))
  target = _placement(target_state, target_procs)
  plan = sp.plan_transfer(manifest, source, target)
  sp.check_plan(plan, manifest)
  assert sp.excess_bytes(plan, manifest) == {t: 0 for t in set(target_procs)}

  # Each source process sends exactly the chunks it wrote: heads 0-3 / 4-7 of
  # the sharded arrays, the replicated arrays once (from process 0).
  k = manifest.layers[0].array("layers/0/k")
  data_keys = [c.key for c in k.chunks if c.key != k.metadata_key]
  for key in data_keys:
    head = int(key.split("/")[-2])
    assert {r.source for r in plan.routes if r.key == key} == {0 if head < 4 else 1}, key
  chunk_bytes = sum(c.nbytes for g in manifest.groups for a in g.arrays for c in a.chunks
                    if c.key != a.metadata_key)
  sent = {p: sum(r.nbytes for r in plan.routes_from(p) if not r.key.endswith("zarr.json"))
          for p in (0, 1)}
  if target_procs == (0, 0):
    assert sent[0] + sent[1] == chunk_bytes  # Every chunk once, nothing twice.
  assert sent[1] > 0 and sent[0] > 0

  # Each target process restores its own shards from only its objects.
  ref = {n: np.asarray(x.astype(jnp.float32)) for n, x in codec.layout.named_leaves(state)}
  for t in set(target_procs):
    got = _restore_process(plan, manifest, blobs, like, target_mesh, t)
    assert got, t
    for name, boxes in got.items():
      for box, data in boxes.items():
        want = ref[name][tuple(slice(a, b) for a, b in box)]
        if name.startswith("layers/0/"):
          want = want.copy()
          want[:, 100:] = 0
        np.testing.assert_array_equal(data, want, err_msg=f"{name} {box} process {t}")


def _store(blobs):
  store = codec.MemoryStore()
  store.put_many(blobs)
  return store


def _two_process_plan():
  state = make_state(_mesh((8,)))
  manifest, blobs = _encode(state)
  source = _placement(state, [0] * 4 + [1] * 4)
  like = jax.eval_shape(lambda: state)
  target_mesh = _mesh((2,))
  target_state = codec.restore_from_store(_store(blobs), manifest, like,
                                          shardings_for(target_mesh))
  target = _placement(target_state, (0, 1))
  return state, manifest, blobs, like, target_mesh, sp.plan_transfer(manifest, source, target)


def test_wrong_plans_are_detected():
  state, manifest, blobs, like, target_mesh, plan = _two_process_plan()
  sp.check_plan(plan, manifest)
  k_route = next(r for r in plan.routes if r.key.startswith("layers/0/k/c/")
                 and r.target == 1)
  without = dataclasses.replace(plan, routes=tuple(r for r in plan.routes if r != k_route))
  with pytest.raises(sp.ShardPlanError, match="needs it and the plan does not send it"):
    sp.check_plan(without, manifest)
  # Negative control for the check itself: restoring from the short plan
  # silently reads zeros where the missing chunk was (a missing zarr3 chunk is
  # the fill value), so a wrong plan is a wrong answer unless it is caught.
  got = _restore_process(without, manifest, blobs, like, target_mesh, 1)
  ref = np.asarray(state.layers[0].k.astype(jnp.float32))
  (box, data), = got["layers/0/k"].items()
  assert not np.array_equal(data[:, :100], ref[tuple(slice(a, b) for a, b in box)][:, :100])

  misrouted = dataclasses.replace(plan, routes=tuple(
      dataclasses.replace(r, target=0) if r == k_route else r for r in plan.routes))
  with pytest.raises(sp.ShardPlanError, match="routed 2 times to process 0|holds none of it"):
    sp.check_plan(misrouted, manifest)
  wrong_sender = dataclasses.replace(plan, routes=tuple(
      dataclasses.replace(r, source=1 - r.source) if r == k_route else r
      for r in plan.routes))
  with pytest.raises(sp.ShardPlanError, match="which does not hold it"):
    sp.check_plan(wrong_sender, manifest)
  doubled = dataclasses.replace(plan, routes=plan.routes + (k_route,))
  with pytest.raises(sp.ShardPlanError, match="routed 2 times"):
    sp.check_plan(doubled, manifest)


def test_chunks_not_aligned_to_the_source_placement_are_refused():
  # Encoded from TP=2 (chunks of 4 heads) but planned as if from TP=8.
  state = make_state(_mesh((2,)))
  manifest, _ = _encode(state)
  source8 = _placement(make_state(_mesh((8,))), [0] * 4 + [1] * 4)
  target = _placement(state, (0, 0))
  with pytest.raises(sp.ShardPlanError, match="not exactly one"):
    sp.plan_transfer(manifest, source8, target)


@pytest.mark.parametrize("heads_per_chunk,excess", [(None, True), (4, False)])
def test_finer_target_needs_aligned_chunks(heads_per_chunk, excess):
  # P=1 (TP=1) -> Q=2 (TP=2): chunks of all 8 heads arrive whole at both
  # target processes unless the encoder also cuts at the target's shard edges.
  state = make_state(_mesh((1,)))
  options = codec.CodecOptions(heads_per_chunk=heads_per_chunk)
  manifest, blobs = _encode(state, options)
  source = _placement(state, (0,))
  like = jax.eval_shape(lambda: state)
  target_state = codec.restore_from_store(_store(blobs), manifest, like,
                                          shardings_for(_mesh((2,))))
  target = _placement(target_state, (0, 1))
  plan = sp.plan_transfer(manifest, source, target)
  sp.check_plan(plan, manifest)
  got = sp.excess_bytes(plan, manifest)
  assert (got[0] > 0 and got[1] > 0) == excess, got
  assert set(plan.bytes_matrix()) == {(0, 0), (0, 1)}


def test_plan_round_trips_through_json():
  *_, plan = _two_process_plan()
  again = sp.ShardPlan.from_dict(__import__("json").loads(plan.to_json()))
  assert again == plan
  assert again.source.mesh.device_processes == (0, 0, 0, 0, 1, 1, 1, 1)
