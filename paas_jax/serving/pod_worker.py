"""One process of a prefill pod or of a decode slice.

  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python -m paas_jax.serving.pod_worker --spec=spec.json --report=out.json

The spec (JSON) says which side, the region (``pod.RegionSpec``), the model
config (``ModelConfig.to_dict``) and seed, and:
  prefill: ``prompt``, ``request_id``, ``targets`` (each slice process's
    StateTransfer address, by slice rank), ``target_mesh``
    (``shard_plan.MeshSpec.to_dict`` of the slice), optional ``codec``
    (``CodecOptions`` fields).
  decode: ``address`` to serve StateTransfer on, ``request_id``,
    ``max_new_tokens``.
The report (JSON) is what the process did: tokens, bytes per peer, timings.
A prefill spec may carry ``fault`` = {"process": p, "at": "prefill"|"transfer"}:
pod process p exits with ``FAULT_EXIT`` in the middle of the prefill (before
its part of the pod program; the others wait in a collective) or of the
transfer (after the manifests are merged, before it sends its shards; the
others send theirs) -- a machine of the pod lost mid-request (tests, demo).

The argument parsing lives in ``main`` (no module-level flags), so tests may
import ``run_prefill`` / ``run_slice``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Sequence

import jax

from paas_jax.codec.encode import encode_groups
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.shard_plan import MeshSpec, check_plan, placement_from_state, plan_transfer
from paas_jax.models.api import Model
from paas_jax.models.config import ModelConfig
from paas_jax.serving import pod, pod_transfer
from paas_jax.state import abstract_state, round_up
from paas_jax.transport.receiver import ReceiverOptions, StateReceiver
from paas_jax.transport.receiver_server import serve_receiver
from paas_jax.transport.sender import SenderOptions


FAULT_EXIT = 75  # the exit status of a pod process that a fault plan killed


def _fault_point(spec: dict, process_id: int, at: str) -> None:
  fault = spec.get("fault") or {}
  if fault.get("process") == process_id and fault.get("at") == at:
    sys.stdout.flush()
    os._exit(FAULT_EXIT)  # no cleanup, no goodbye to the coordinator: a lost machine


def run_prefill(spec: dict) -> dict:
  """Prefills ``spec["prompt"]`` on the pod and streams this process's shards."""
  region = pod.RegionSpec.from_dict(spec["region"])
  config = ModelConfig.from_dict(spec["config"])
  mesh = pod.region_mesh()
  barrier = pod.Barrier(region)
  t0 = time.perf_counter()
  checksum = None
  if "synthetic_tokens" in spec:
    token_count, first = int(spec["synthetic_tokens"]), 0
    state = pod.synthetic_state(config, mesh, token_count, int(spec.get("seed", 0)))
    checksum = pod.state_checksum(state, barrier)
  else:
    model = pod.shard_model(Model.create(config, int(spec.get("seed", 0))), mesh)
    prompt = [int(t) for t in spec["prompt"]]
    token_count = len(prompt)
    _fault_point(spec, region.process_id, "prefill")
    first, state = pod.region_prefill(model, mesh, prompt, barrier=barrier)
  jax.block_until_ready(state)
  prefill_s = time.perf_counter() - t0
  barrier("transfer")  # Every pod process starts the transfer together.

  start_wall = time.time()
  t1 = time.perf_counter()
  options = CodecOptions(**spec.get("codec", {}))
  groups = list(encode_groups(state, options=options, token_count=token_count))
  mine = pod_transfer.partial_manifest(
      groups, model_id=config.name, config_fingerprint=config.fingerprint(),
      token_count=token_count, batch=1, options=options)
  if region.num_processes > 1:
    merged = pod_transfer.exchange_manifests(
        mine, key=f"pod/{spec['request_id']}/manifest", process_id=region.process_id,
        num_processes=region.num_processes, timeout_s=region.timeout_s, kv=pod.kv_client())
  else:
    merged = mine
  source = placement_from_state(state)
  target = pod.state_placement(config, MeshSpec.from_dict(spec["target_mesh"]))
  manifest = dataclasses.replace(merged, placements={"source": source.to_dict(),
                                                     "target": target.to_dict()})
  plan = plan_transfer(manifest, source, target)
  check_plan(plan, manifest)
  envelope = pod_transfer.Envelope(manifest, first, region.num_processes)
  _fault_point(spec, region.process_id, "transfer")
  timeout = region.timeout_s
  sent = pod_transfer.send_shards(
      groups, plan, envelope, source=region.process_id, targets=spec["targets"],
      request_id=spec["request_id"], model_id=config.name,
      config_fingerprint=config.fingerprint(),
      options=SenderOptions(rpc_timeout_s=timeout, commit_timeout_s=timeout,
                            transfer_timeout_s=timeout))
  encoded = sorted(k for g in groups for k in g.blobs if not k.endswith("zarr.json"))
  return {
      "role": "prefill", "process": region.process_id, "first_token": first,
      "prefill_s": prefill_s, "transfer_s": time.perf_counter() - t1,
      "transfer_start_wall": start_wall, "checksum": checksum,
      "encoded_keys": encoded,
      "encoded_bytes": sum(len(v) for g in groups for k, v in g.blobs.items()
                           if not k.endswith("zarr.json")),
      "state_bytes": manifest.nbytes,
      "sent": [dataclasses.asdict(s) for s in sent],
  }


def start_slice_receiver(config: ModelConfig, address: str, timeout_s: float):
  """A StateTransfer server for one slice process (no template: the objects are
  kept verified and restored by ``pod_transfer.restore``)."""
  receiver = StateReceiver(
      models={config.name: config.fingerprint()},
      options=ReceiverOptions(transfer_timeout_s=timeout_s, idle_timeout_s=timeout_s))
  return serve_receiver(receiver, address)


def run_slice(spec: dict, server=None, devices: Sequence[Any] | None = None) -> dict:
  """Receives one request's state from the pod, restores this process's shards
  and decodes greedily on the slice. ``server``: an already started receiver
  (else one is served on ``spec["address"]``); ``devices``: the slice's
  devices when it is a single process that owns more (tests)."""
  region = pod.RegionSpec.from_dict(spec["region"])
  config = ModelConfig.from_dict(spec["config"])
  own_server = server is None
  if own_server:
    server = start_slice_receiver(config, spec["address"], region.timeout_s)
  try:
    mesh = pod.region_mesh(devices)
    barrier = pod.Barrier(region)
    synthetic = "synthetic_tokens" in spec
    if not synthetic:
      model = pod.shard_model(Model.create(config, int(spec.get("seed", 0))), mesh)
    max_new = 0 if synthetic else int(spec["max_new_tokens"])
    collected = pod_transfer.collect(server.receiver, spec["request_id"], region.process_id,
                                     region.timeout_s)
    t0 = time.perf_counter()
    prompt_len = collected.envelope.manifest.token_count
    capacity = prompt_len if synthetic else round_up(prompt_len + max_new)
    placement = pod.state_placement(config, MeshSpec.from_mesh(mesh))
    received = sorted(collected.received)
    wire = collected.wire_bytes
    state = pod_transfer.restore(collected, region.process_id, placement,
                                 abstract_state(config, 1, capacity),
                                 pod.state_shardings(config, mesh, 1, capacity))
    jax.block_until_ready(state)
    restore_s = time.perf_counter() - t0
    done_wall = time.time()
    if synthetic:
      return {"role": "decode", "process": region.process_id, "tokens": [],
              "checksum": pod.state_checksum(state, barrier), "received_keys": received,
              "wire_bytes": wire, "restore_s": restore_s, "done_wall": done_wall}
    token = collected.envelope.first_token
    tokens = [token]
    for _ in range(max_new - 1):
      token, state = pod.region_step(model, mesh, state, token, barrier=barrier)
      tokens.append(token)
    return {"role": "decode", "process": region.process_id, "tokens": tokens,
            "received_keys": [k for k in received if not k.endswith("zarr.json")],
            "wire_bytes": wire, "restore_s": restore_s, "done_wall": done_wall}
  finally:
    if own_server:
      server.stop(grace=None)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--spec", required=True, help="JSON spec file")
  parser.add_argument("--report", required=True, help="where to write the JSON report")
  args = parser.parse_args(argv)
  with open(args.spec) as f:
    spec = json.load(f)
  pod.initialize_region(pod.RegionSpec.from_dict(spec["region"]))
  report = run_prefill(spec) if spec["role"] == "prefill" else run_slice(spec)
  with open(args.report, "w") as f:
    json.dump(report, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
