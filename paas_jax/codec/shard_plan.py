"""Shard-to-shard transfer plans between two multi-process JAX programs.

A state produced by a pod of P processes (one mesh over all their devices) is
restored by a slice of Q processes with a different mesh. Nothing goes through
one host: each source process sends only the chunks it wrote (its
``replica_id == 0`` shards; the codec aligns chunks to shard boundaries, so
every chunk lies inside exactly one source shard), and each target process
receives only the chunks that intersect the boxes its own devices hold in the
target sharding.

Everything here is pure data: a mesh is ``MeshSpec`` (axis sizes and the
process of each device), an array's placement is its ``PartitionSpec`` as a
tuple, and boxes are computed the way ``NamedSharding`` splits an array, so
plans are computed and checked without devices or processes.
``MeshSpec.from_mesh`` / ``placement_from_state`` turn live JAX objects into
these descriptions.

Boxes are tuples of half-open ``(start, stop)`` per axis, in the leaf's
coordinates (the stored arrays of trimmed caches are prefixes of the leaf
along the token axis, so chunk boxes use the same coordinates).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping, Sequence

from paas_jax.codec.manifest import ArrayEntry, StateManifest

Box = tuple[tuple[int, int], ...]
# One PartitionSpec entry per array axis: None, a mesh axis name, or a tuple of names.
SpecEntry = Any
Spec = tuple[SpecEntry, ...]


class ShardPlanError(ValueError):
  """A plan that would lose, duplicate or misroute bytes (or an impossible one)."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """A device mesh as data.

  Attributes:
    axis_names, axis_sizes: the mesh axes, major first.
    device_processes: the process index of each device, in the mesh's flat
      row-major device order (``mesh.devices.flat``).
  """

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  device_processes: tuple[int, ...]

  def __post_init__(self):
    if len(self.axis_names) != len(self.axis_sizes):
      raise ShardPlanError(f"mesh has {len(self.axis_names)} axis names and "
                           f"{len(self.axis_sizes)} sizes")
    if math.prod(self.axis_sizes) != len(self.device_processes):
      raise ShardPlanError(f"mesh of shape {self.axis_sizes} needs "
                           f"{math.prod(self.axis_sizes)} devices, got "
                           f"{len(self.device_processes)}")

  @property
  def processes(self) -> tuple[int, ...]:
    return tuple(sorted(set(self.device_processes)))

  def coords(self, flat_index: int) -> dict[str, int]:
    """Mesh coordinates of the device at ``flat_index``."""
    out = {}
    for name, size in reversed(list(zip(self.axis_names, self.axis_sizes))):
      out[name] = flat_index % size
      flat_index //= size
    return out

  def to_dict(self) -> dict:
    return {"axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes),
            "device_processes": list(self.device_processes)}

  @classmethod
  def from_dict(cls, d: Mapping) -> "MeshSpec":
    return cls(tuple(str(a) for a in d["axis_names"]), tuple(int(s) for s in d["axis_sizes"]),
               tuple(int(p) for p in d["device_processes"]))

  @classmethod
  def from_mesh(cls, mesh) -> "MeshSpec":
    """From a ``jax.sharding.Mesh`` (devices of every process, not only ours)."""
    return cls(tuple(mesh.axis_names), tuple(int(s) for s in mesh.devices.shape),
               tuple(int(d.process_index) for d in mesh.devices.flat))


def _entry_axes(entry: SpecEntry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def device_boxes(mesh: MeshSpec, spec: Spec, shape: Sequence[int]) -> list[Box]:
  """The box each device holds, in the mesh's flat device order, as
  ``NamedSharding(mesh, PartitionSpec(*spec))`` places an array of ``shape``."""
  shape = tuple(int(s) for s in shape)
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  if len(spec) != len(shape):
    raise ShardPlanError(f"spec {spec} has more entries than the array has axes {shape}")
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  for entry in spec:
    for axis in _entry_axes(entry):
      if axis not in sizes:
        raise ShardPlanError(f"spec names mesh axis {axis!r}; the mesh has {mesh.axis_names}")
  boxes = []
  for flat in range(len(mesh.device_processes)):
    coords = mesh.coords(flat)
    box = []
    for entry, n in zip(spec, shape):
      parts, index = 1, 0
      for axis in _entry_axes(entry):  # Major axis first, as NamedSharding.
        parts *= sizes[axis]
        index = index * sizes[axis] + coords[axis]
      if n % parts:
        raise ShardPlanError(f"spec {spec} splits an axis of size {n} into {parts} parts; "
                             "JAX shards only evenly")
      step = n // parts
      box.append((index * step, (index + 1) * step))
    boxes.append(tuple(box))
  return boxes


def writer_boxes(mesh: MeshSpec, spec: Spec, shape: Sequence[int]) -> dict[int, list[Box]]:
  """Process -> the boxes it writes: each distinct box once, by the first device
  in mesh order that holds it (JAX's ``replica_id == 0``, what the encoder writes)."""
  out: dict[int, list[Box]] = {}
  seen = set()
  for box, process in zip(device_boxes(mesh, spec, shape), mesh.device_processes):
    if box in seen:
      continue
    seen.add(box)
    out.setdefault(process, []).append(box)
  return out


def reader_boxes(mesh: MeshSpec, spec: Spec, shape: Sequence[int]) -> dict[int, list[Box]]:
  """Process -> the distinct boxes its devices hold (what it must restore)."""
  out: dict[int, list[Box]] = {}
  for box, process in zip(device_boxes(mesh, spec, shape), mesh.device_processes):
    boxes = out.setdefault(process, [])
    if box not in boxes:
      boxes.append(box)
  return out


def intersects(a: Box, b: Box) -> bool:
  return all(max(lo0, lo1) < min(hi0, hi1) for (lo0, hi0), (lo1, hi1) in zip(a, b))


def contains(outer: Box, inner: Box) -> bool:
  return all(lo0 <= lo1 and hi1 <= hi0 for (lo0, hi0), (lo1, hi1) in zip(outer, inner))


def box_size(box: Box) -> int:
  return math.prod(max(0, hi - lo) for lo, hi in box)


@dataclasses.dataclass(frozen=True)
class StatePlacement:
  """Where a state's leaves live: the mesh and each leaf's partition spec.

  ``specs`` maps leaf names (``layers/3/k``, ``lengths``) to spec tuples; a
  leaf not listed is replicated.
  """

  mesh: MeshSpec
  specs: Mapping[str, Spec]

  def spec(self, name: str) -> Spec:
    return tuple(self.specs.get(name, ()))

  def to_dict(self) -> dict:
    return {"mesh": self.mesh.to_dict(),
            "specs": {n: [list(e) if isinstance(e, tuple) else e for e in s]
                      for n, s in sorted(self.specs.items())}}

  @classmethod
  def from_dict(cls, d: Mapping) -> "StatePlacement":
    specs = {str(n): tuple(tuple(e) if isinstance(e, list) else e for e in s)
             for n, s in d["specs"].items()}
    return cls(MeshSpec.from_dict(d["mesh"]), specs)


def placement_from_state(state: Any) -> StatePlacement:
  """The placement of a state (or template) whose leaves carry ``NamedSharding``s
  of one mesh. Leaves without a named sharding count as replicated."""
  # Imported here: the rest of this module is JAX-free data.
  from paas_jax.codec import layout  # pylint: disable=g-import-not-at-top
  mesh, specs = None, {}
  for name, leaf in layout.named_leaves(state):
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(sharding, "spec"):
      continue
    if mesh is None:
      mesh = sharding.mesh
    elif sharding.mesh != mesh:
      raise ShardPlanError(f"leaf {name!r} lives on another mesh than the others")
    specs[name] = tuple(sharding.spec)
  if mesh is None:
    raise ShardPlanError("no leaf of the state carries a NamedSharding")
  return StatePlacement(MeshSpec.from_mesh(mesh), specs)


def _leaf_name(array: ArrayEntry) -> str:
  return array.name.split("@", 1)[0]


def _array_spec(placement: StatePlacement, array: ArrayEntry,
                data: ArrayEntry | None) -> Spec:
  """The spec of a stored array: its leaf's, minus the token axis for a scale."""
  spec = placement.spec(_leaf_name(array))
  if array.role == "scale" and data is not None and data.token_axis is not None:
    spec = spec + (None,) * (len(data.shape) - len(spec))
    spec = tuple(e for i, e in enumerate(spec) if i != data.token_axis)
  return spec


def chunk_box(array: ArrayEntry, key: str) -> Box | None:
  """The box of a chunk object in the array's coordinates, None for ``zarr.json``."""
  if key == array.metadata_key:
    return None
  prefix = f"{array.name}/c"
  if not key.startswith(prefix):
    raise ShardPlanError(f"object {key!r} is not a chunk of array {array.name!r}")
  rest = key[len(prefix):]
  cell = [int(x) for x in rest.split("/")[1:]] if rest else []
  if len(cell) != len(array.stored_shape):
    raise ShardPlanError(f"chunk {key!r} has {len(cell)} indices, array has "
                         f"{len(array.stored_shape)} axes")
  return tuple((i * c, min((i + 1) * c, n))
               for i, c, n in zip(cell, array.chunk_shape, array.stored_shape))


@dataclasses.dataclass(frozen=True)
class Route:
  """One object sent from source process ``source`` to target process ``target``."""

  key: str
  array: str
  nbytes: int
  source: int
  target: int


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Every object of a state and which source process sends it to which target.

  Attributes:
    source, target: the two placements (both meshes are recorded here).
    routes: one per (object, receiving process).
  """

  source: StatePlacement
  target: StatePlacement
  routes: tuple[Route, ...]

  def routes_from(self, source: int) -> list[Route]:
    return [r for r in self.routes if r.source == source]

  def routes_to(self, target: int) -> list[Route]:
    return [r for r in self.routes if r.target == target]

  def keys_to(self, target: int) -> set[str]:
    return {r.key for r in self.routes if r.target == target}

  def bytes_matrix(self) -> dict[tuple[int, int], int]:
    """(source, target) -> bytes sent."""
    out: dict[tuple[int, int], int] = {}
    for r in self.routes:
      out[(r.source, r.target)] = out.get((r.source, r.target), 0) + r.nbytes
    return out

  def bytes_sent(self, source: int) -> int:
    return sum(r.nbytes for r in self.routes if r.source == source)

  def bytes_received(self, target: int) -> int:
    return sum(r.nbytes for r in self.routes if r.target == target)

  def to_dict(self) -> dict:
    return {"source": self.source.to_dict(), "target": self.target.to_dict(),
            "routes": [dataclasses.asdict(r) for r in self.routes]}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: Mapping) -> "ShardPlan":
    return cls(StatePlacement.from_dict(d["source"]), StatePlacement.from_dict(d["target"]),
               tuple(Route(**r) for r in d["routes"]))


def _arrays(manifest: StateManifest) -> Iterable[tuple[ArrayEntry, ArrayEntry | None]]:
  """(array, its data array for a scale) of every stored array."""
  for group in manifest.groups:
    by_name = {a.name: a for a in group.arrays}
    for array in group.arrays:
      yield array, by_name.get(_leaf_name(array)) if array.role == "scale" else None


def plan_transfer(manifest: StateManifest, source: StatePlacement,
                  target: StatePlacement) -> ShardPlan:
  """Routes every object of ``manifest`` from the source process that wrote it to
  every target process whose devices hold part of it.

  A chunk goes to a target process iff its box intersects one of the boxes
  that process's devices hold; it is sent by the source process that writes
  the (single) source box containing it. Every array's ``zarr.json`` goes to
  every target process, from the writer of the array's first box.

  Raises:
    ShardPlanError: a chunk straddles source shards (it was not encoded with
      this source placement) or the placements name unknown mesh axes.
  """
  routes = []
  for array, data in _arrays(manifest):
    spec_shape = array.shape
    writers = writer_boxes(source.mesh, _array_spec(source, array, data), spec_shape)
    readers = reader_boxes(target.mesh, _array_spec(target, array, data), spec_shape)
    meta_source = min(writers)
    for chunk in array.chunks:
      box = chunk_box(array, chunk.key)
      if box is None:
        for t in sorted(readers):
          routes.append(Route(chunk.key, array.name, chunk.nbytes, meta_source, t))
        continue
      owners = [p for p, boxes in writers.items() if any(contains(b, box) for b in boxes)]
      if len(owners) != 1:
        raise ShardPlanError(
            f"chunk {chunk.key!r} (box {box}) lies inside the shards of source processes "
            f"{owners}, not exactly one: it was not encoded with this source placement")
      for t in sorted(readers):
        if any(intersects(b, box) for b in readers[t]):
          routes.append(Route(chunk.key, array.name, chunk.nbytes, owners[0], t))
  return ShardPlan(source, target, tuple(routes))


def check_plan(plan: ShardPlan, manifest: StateManifest) -> None:
  """Raises ``ShardPlanError`` unless the plan delivers each target process
  exactly the objects its devices need, each once and each from the source
  process that wrote it.

  Checked per array, from the placements alone: every listed chunk that
  intersects a target process's boxes is routed to it; no chunk goes to a
  process that holds none of it; no object is routed twice to one process
  or from a process that does not hold it in the source sharding; every
  target process gets every array's ``zarr.json``; no route names an object
  the manifest does not list.
  """
  problems = []
  listed = {}
  for array, data in _arrays(manifest):
    for chunk in array.chunks:
      listed[chunk.key] = (array, data, chunk)
  seen: dict[tuple[str, int], int] = {}
  for r in plan.routes:
    seen[(r.key, r.target)] = seen.get((r.key, r.target), 0) + 1
    if r.key not in listed:
      problems.append(f"{r.key}: routed but not in the manifest")
      continue
    array, data, chunk = listed[r.key]
    if r.nbytes != chunk.nbytes:
      problems.append(f"{r.key}: routed as {r.nbytes} bytes, manifest lists {chunk.nbytes}")
    box = chunk_box(array, r.key)
    if box is None:
      continue
    held = device_boxes(plan.source.mesh, _array_spec(plan.source, array, data), array.shape)
    if not any(contains(b, box) and p == r.source
               for b, p in zip(held, plan.source.mesh.device_processes)):
      problems.append(f"{r.key}: sent by process {r.source}, which does not hold it")
    wanted = reader_boxes(plan.target.mesh, _array_spec(plan.target, array, data),
                          array.shape).get(r.target, [])
    if not any(intersects(b, box) for b in wanted):
      problems.append(f"{r.key}: sent to process {r.target}, which holds none of it")
  problems += [f"{k}: routed {n} times to process {t}" for (k, t), n in seen.items() if n > 1]
  for key, (array, data, chunk) in listed.items():
    box = chunk_box(array, key)
    readers = reader_boxes(plan.target.mesh, _array_spec(plan.target, array, data),
                           array.shape)
    for t, boxes in readers.items():
      needed = box is None or any(intersects(b, box) for b in boxes)
      if needed and (key, t) not in seen:
        problems.append(f"{key}: process {t} needs it and the plan does not send it")
  if problems:
    shown = "; ".join(problems[:8])
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    raise ShardPlanError(f"bad shard plan: {shown}{more}")


def excess_bytes(plan: ShardPlan, manifest: StateManifest) -> dict[int, int]:
  """Target process -> bytes it receives that lie outside its boxes (a chunk
  coarser than the target's shards arrives whole). Zero when every chunk
  boundary is also a target shard boundary. ``zarr.json`` does not count."""
  listed = {c.key: (a, d) for a, d in _arrays(manifest) for c in a.chunks}
  out = {t: 0 for t in plan.target.mesh.processes}
  for r in plan.routes:
    array, data = listed[r.key]
    box = chunk_box(array, r.key)
    if box is None:
      continue
    boxes = reader_boxes(plan.target.mesh, _array_spec(plan.target, array, data),
                         array.shape).get(r.target, [])
    inside = sum(box_size(tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, o)))
                 for o in boxes if intersects(o, box))
    out[r.target] += r.nbytes - r.nbytes * min(inside, box_size(box)) // box_size(box)
  return out
