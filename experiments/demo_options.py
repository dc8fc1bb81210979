"""How the two-region demo's flags combine (pure; experiments/demo_two_region.py).

Region A as a pod (--prefill_pod) and region B's PD nodes as decode slices
(--decode_slice processes each, on --slice_nodes nodes) each rule out some of
the demo's other settings (``launch_args.check_decode_slice`` lists the slice's). A setting the user left
at its default is changed to one that fits, with a note to print; one the user
asked for is refused with a ``UsageError`` naming the flag, before anything
starts.
"""

from __future__ import annotations

import dataclasses
from typing import Container

from absl import app

# Faults that kill or damage something only a single-process region A has
# (chunk streaming and commit points), and those that need a pod.
SINGLE_PREFILL_FAULTS = ("kill_prefill", "preempt_prefill", "corrupt_chunks")
POD_FAULTS = ("kill_pod_process",)


@dataclasses.dataclass(frozen=True)
class PoolSettings:
  """Region A's pod size and the prefix cache block after the slice's needs,
  TLS (a slice runs with it as any region does), and the notes saying what
  was changed from a default."""
  prefill_pod: int
  prefix_block: int
  tls: bool
  notes: tuple[str, ...] = ()


def resolve_pools(*, decode_slice: int, decode_slice_devices: int, prefill_pod: int,
                  prefix_block: int, pd_nodes: int, decode_regions: int, fault: str,
                  tls: bool, explicit: Container[str], slice_nodes: int = 1) -> PoolSettings:
  """Checks --prefill_pod / --decode_slice / --slice_nodes against the rest.
  ``explicit``: the names of the flags the user set (the others are at their
  defaults)."""
  if prefill_pod < 1:
    raise app.UsageError(f"--prefill_pod must be >= 1, got {prefill_pod}")
  if decode_slice < 1 or decode_slice_devices < 1:
    raise app.UsageError(f"--decode_slice ({decode_slice}) and --decode_slice_devices "
                         f"({decode_slice_devices}) must be >= 1")
  if slice_nodes < 1:
    raise app.UsageError(f"--slice_nodes must be >= 1, got {slice_nodes}")
  if slice_nodes > 1 and decode_slice == 1:
    raise app.UsageError(f"--slice_nodes={slice_nodes} makes PD nodes decode slices: it needs "
                         "--decode_slice > 1 (the processes of each)")
  if slice_nodes > pd_nodes:
    raise app.UsageError(f"--slice_nodes={slice_nodes} slices need as many PD nodes: "
                         f"--pd_nodes={pd_nodes}")
  if decode_slice == 1:
    if decode_slice_devices > 1:
      raise app.UsageError("--decode_slice_devices applies to a decode slice: it needs "
                           "--decode_slice > 1")
    _check_fault(fault, prefill_pod)
    return PoolSettings(prefill_pod, prefix_block, tls)
  notes = []
  where = f"a decode slice (--decode_slice={decode_slice})"
  if prefill_pod < 2:
    # A slice takes a pod's per-process parts (launch_args.prefill_args).
    if "prefill_pod" in explicit:
      notes.append(f"{where} takes a pod's parts: region A runs as a pod of one process")
    else:
      prefill_pod = 2
      notes.append(f"{where} takes its parts from a prefill pod: region A runs as one "
                   "(--prefill_pod=2)")
  if prefix_block > 0:
    # Each slice process keeps its shards of the cached prefixes (slice_prefix);
    # region A's pod keeps none, and the slice's is neither probed nor shipped.
    notes.append(f"{where} keeps a prefix cache (--prefix_block={prefix_block}) for its own "
                 "local prefills only; region A's pod keeps none and no prefix is shipped "
                 "to or from the slice")
  if slice_nodes > 1:  # PD nodes 0 .. slice_nodes - 1 are slices, the rest single
    notes.append(f"PD nodes 0..{slice_nodes - 1} are {slice_nodes} decode slices of "
                 f"{decode_slice} processes each (role both)"
                 + (f"; the other {pd_nodes - slice_nodes} PD node(s) are single decode "
                    "servers" if pd_nodes > slice_nodes else ""))
  elif pd_nodes > 1:  # PD node 0 is the slice, the others single decode servers
    notes.append(f"{where} is PD node 0 (\"decode\", role both); the other "
                 f"{pd_nodes - 1} PD node(s) are single decode servers")
  if decode_regions > 1:
    notes.append(f"each of the {decode_regions} decode regions runs its own "
                 f"{where.removeprefix('a ')}")
  if fault in SINGLE_PREFILL_FAULTS:
    raise app.UsageError(f"--fault={fault} needs a single-process region A (chunk "
                         f"streaming), and {where} needs a prefill pod")
  _check_fault(fault, prefill_pod)
  return PoolSettings(prefill_pod, prefix_block, tls, tuple(notes))


def _check_fault(fault: str, prefill_pod: int) -> None:
  if fault in POD_FAULTS and prefill_pod < 2:
    raise app.UsageError(f"--fault={fault} needs --prefill_pod > 1")
  if fault in SINGLE_PREFILL_FAULTS and prefill_pod > 1:
    raise app.UsageError(f"--fault={fault} needs --prefill_pod = 1 (chunk streaming)")
