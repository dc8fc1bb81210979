"""A region as one multi-process JAX program: a prefill *pod* or a decode *slice*.

The processes of a region call ``initialize_region`` (``jax.distributed`` with a
coordinator; CPU collectives through gloo), build one mesh over every
process's devices (``region_mesh``), place the parameters with the
tensor-parallel policy of ``paas_jax.checkpoints.sharding`` (``shard_model``)
and the decode state with ``state_partition_specs`` (KV, recurrent and SSM
caches split by head where the mesh divides the heads; conv tails, MLA
latents and ``lengths`` replicated). ``region_prefill`` and ``region_step``
run the model's jitted prefill / decode step on global arrays, so every
process runs the same program and holds only its own shards.

How the state crosses from a pod to a slice, shard to shard, is
``paas_jax.serving.pod_transfer``; ``python -m paas_jax.serving.pod_worker``
runs one process of either side.

P = Q = 1 needs none of this: the single-process servers are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paas_jax.checkpoints.hf_import import model_from_params
from paas_jax.checkpoints.sharding import param_shardings
from paas_jax.codec import layout
from paas_jax.codec.shard_plan import MeshSpec, StatePlacement
from paas_jax.models.api import Model, prefill_bucket
from paas_jax.models.config import ModelConfig
from paas_jax.state import DecodeState, abstract_state, init_state, round_up, sensitivity

TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class RegionSpec:
  """One process's view of its region.

  Attributes:
    coordinator: ``host:port`` of the region's ``jax.distributed`` coordinator
      (served by process 0).
    num_processes, process_id: the group and this process's rank in it.
    local_devices: devices each process contributes (on CPU,
      ``--xla_force_host_platform_device_count``).
    timeout_s: deadline of joining the group and of every exchange through
      the coordinator; a peer that died makes the others fail after at most
      this long instead of hanging.
  """

  coordinator: str
  num_processes: int
  process_id: int
  local_devices: int
  timeout_s: float = 60.0

  @property
  def tp(self) -> int:
    return self.num_processes * self.local_devices

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "RegionSpec":
    return cls(str(d["coordinator"]), int(d["num_processes"]), int(d["process_id"]),
               int(d["local_devices"]), float(d.get("timeout_s", 60.0)))


def initialize_region(spec: RegionSpec) -> None:
  """Joins the region's process group (call once, before any other JAX use).

  Raises:
    RuntimeError: this process does not have ``spec.local_devices`` devices.
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service would take SIGTERM for a preemption notice, so a
  # follower kept running when its supervisor stopped the region and then
  # aborted ("JAX distributed service detected fatal errors") once process 0
  # and its coordination service were gone. SIGTERM here means stop: a
  # follower keeps nothing and dies at once; process 0 has its own handler.
  jax.config.update("jax_enable_preemption_service", False)
  if spec.num_processes > 1:
    timeout = max(1, int(spec.timeout_s))
    jax.distributed.initialize(
        coordinator_address=spec.coordinator, num_processes=spec.num_processes,
        process_id=spec.process_id, initialization_timeout=timeout,
        heartbeat_timeout_seconds=max(10, timeout // 2),
        shutdown_timeout_seconds=timeout)
  if jax.local_device_count() != spec.local_devices:
    raise RuntimeError(f"process {spec.process_id} has {jax.local_device_count()} devices, "
                       f"the region spec says {spec.local_devices} (set XLA_FLAGS="
                       "--xla_force_host_platform_device_count before JAX starts)")


def kv_client():
  """The region's coordination key-value store (deadline-bounded gets and
  barriers), or None outside ``jax.distributed``. JAX exposes it only through
  this private module."""
  # Deferred: a private JAX module (it may move between JAX versions); only a pod
  # process with jax.distributed initialised gets here.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


# How long a process waits at the barrier after compiling for its peers to
# finish compiling the same program: compiles on a loaded host took minutes
# (a pod's warm-up failed once at the region's 60 s); a peer that dies meanwhile
# still ends the wait (the coordination service and the supervisor).
COMPILE_SKEW_S = 600.0


class Barrier:
  """Named barriers of one region through the coordinator, each with the
  region's deadline: ``barrier("prefill")`` returns once every process got
  there, or raises after ``timeout_s`` (a dead or stuck peer; at least
  ``COMPILE_SKEW_S`` with ``after_compile``)."""

  def __init__(self, spec: RegionSpec):
    self.spec = spec
    self._count = 0

  def __call__(self, name: str, after_compile: bool = False) -> None:
    if self.spec.num_processes == 1:
      return
    self._count += 1
    timeout_s = max(self.spec.timeout_s, COMPILE_SKEW_S) if after_compile else self.spec.timeout_s
    kv_client().wait_at_barrier(f"region/{name}/{self._count}", int(timeout_s * 1000))


def _no_barrier(name: str, after_compile: bool = False) -> None:
  del name, after_compile


_COMPILED: dict = {}


def synchronized_call(jitted, static: tuple[int, ...], args: tuple, barrier, name: str):
  """Compiles ``jitted`` for ``args``, waits for the whole region at ``barrier``,
  then runs it. Gloo gives a collective only a short while for every process
  to join, and a process still compiling (compiles take long on a loaded
  host) would fail the others; compiling first makes the collectives start
  together. Compiled programs are kept per (function, static args, avals)."""
  key, dynamic, statics = _program_key(static, args, name)
  entry = _COMPILED.get(key)
  if entry is None:
    # The static arguments stay referenced so that an id in the key is never reused.
    entry = (jitted.lower(*args).compile(), statics)
    barrier(name, after_compile=True)
    _COMPILED[key] = entry
  return entry[0](*dynamic)


def precompile(jitted, static: tuple[int, ...], args: tuple, name: str) -> bool:
  """Compiles what ``synchronized_call(jitted, static, args, ..., name)`` would,
  without running it (so without any collective): ``args``' dynamic leaves may
  be ``jax.ShapeDtypeStruct``s carrying the arrays' shardings. Returns whether
  it compiled (False: already compiled)."""
  key, _, statics = _program_key(static, args, name)
  if key in _COMPILED:
    return False
  _COMPILED[key] = (jitted.lower(*args).compile(), statics)
  return True


def _program_key(static: tuple[int, ...], args: tuple, name: str):
  """(key of the compiled program, dynamic args, static args): a program per
  function name, static arguments and the dynamic leaves' shapes, dtypes and
  shardings (an array and a ``ShapeDtypeStruct`` alike)."""
  dynamic = tuple(a for i, a in enumerate(args) if i not in static)
  leaves, treedef = jax.tree_util.tree_flatten(dynamic)
  statics = tuple(args[i] for i in static)
  key = (name, tuple(_static_key(a) for a in statics), treedef,
         tuple((np.shape(x), getattr(x, "dtype", type(x)),
                _canonical_sharding(getattr(x, "sharding", None))) for x in leaves))
  return key, dynamic, statics


@functools.lru_cache(maxsize=1024)
def _canonical_sharding(sharding):
  """``sharding`` with a ``NamedSharding``'s trailing unsharded axes dropped:
  ``P(None, "tp", None, None)`` (what ``state_shardings`` says) and
  ``P(None, "tp")`` (what a program's output carries) are one layout, and so
  one compiled program."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = list(sharding.spec)
  while spec and spec[-1] is None:
    spec.pop()
  return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _static_key(x):
  """A model's graph definition by identity: flax hashes a ``GraphDef`` anew on
  every call (~2 ms for a small model: as much as a decode step's own work),
  and a region keeps one per model."""
  return ("graphdef", id(x)) if isinstance(x, nnx.graph.GraphDef) else x


def region_mesh(devices: Sequence[Any] | None = None) -> Mesh:
  """A 1-D ``tp`` mesh over ``devices`` (default: every device of every process),
  ordered by process, so each process holds a contiguous range of shards."""
  devices = list(jax.devices() if devices is None else devices)
  devices.sort(key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices), (TP_AXIS,))


def state_partition_specs(config: ModelConfig, tp: int) -> dict[str, tuple]:
  """Leaf name -> partition spec of a ``DecodeState`` on a ``tp`` mesh (pure).

  Caches are split by head when ``tp`` divides the head count (attention and
  sliding-window KV ``[b, s, h, d]``, Gated DeltaNet / Mamba2 states
  ``[b, h, ...]``); everything else is replicated.
  """
  shapes = abstract_state(config, 1, 16)
  specs = {}
  for name, leaf in layout.named_leaves(shapes):
    parts = name.split("/")
    axis = None
    if len(parts) == 3:
      layer = shapes.layers[int(parts[1])]
      axis = layout.role_of(layer, [parts[2]]).head_axis
    if axis is not None and tp > 1 and leaf.shape[axis] % tp == 0:
      spec = [None] * len(leaf.shape)
      spec[axis] = TP_AXIS
      specs[name] = tuple(spec)
    else:
      specs[name] = ()
  return specs


def state_placement(config: ModelConfig, mesh: MeshSpec) -> StatePlacement:
  """Where ``state_partition_specs`` puts a state on ``mesh`` (pure)."""
  return StatePlacement(mesh, state_partition_specs(config, int(np.prod(mesh.axis_sizes))))


def state_shardings(config: ModelConfig, mesh: Mesh, batch: int, capacity: int) -> DecodeState:
  """A ``DecodeState``-shaped pytree of ``NamedSharding``s."""
  specs = state_partition_specs(config, mesh.size)
  like = abstract_state(config, batch, capacity)
  names = [n for n, _ in layout.named_leaves(like)]
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(like),
      [NamedSharding(mesh, PartitionSpec(*specs[n])) for n in names])


@functools.lru_cache(maxsize=128)
def _empty_state_program(config: ModelConfig, batch: int, capacity: int,
                         shardings: "StaticShardings"):
  return jax.jit(lambda: init_state(config, batch, capacity), out_shardings=shardings.tree)


def empty_state(config: ModelConfig, batch: int, capacity: int, shardings) -> DecodeState:
  """An all-zeros ``DecodeState`` [batch, capacity] placed by ``shardings``
  (``state_shardings``'s tree; one compiled program per shape, not one per call)."""
  return _empty_state_program(config, batch, capacity, StaticShardings(shardings))()


def replicated(mesh: Mesh, value) -> jax.Array:
  """A global array holding the same host ``value`` on every device of ``mesh``
  (every process passes the same value)."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, NamedSharding(mesh, PartitionSpec()),
                                      lambda index: value[index])


def shard_model(model: Model, mesh: Mesh) -> Model:
  """The same parameters placed on ``mesh`` by the default tensor-parallel policy.

  Every process must hold the same host values (e.g. ``Model.create(config,
  seed)`` with one seed); each copies only its own shards.
  """
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(model.params))
  host = {p: np.asarray(x) for p, x in flat.items()}
  shardings = param_shardings({p: x.shape for p, x in host.items()}, mesh)
  placed = {p: jax.make_array_from_callback(x.shape, shardings[p],
                                            lambda index, x=x: x[index])
            for p, x in host.items()}
  return model_from_params(model.config, placed)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _sharded_prefill(graphdef, params, tokens, state, n_valid, out_shardings):
  logits, state = nnx.merge(graphdef, params).prefill(tokens, state, n_valid)
  last = logits[jnp.arange(logits.shape[0]), n_valid - 1]
  token = jnp.argmax(last, axis=-1).astype(jnp.int32)
  return token, jax.lax.with_sharding_constraint(state, out_shardings.tree)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _sharded_step(graphdef, params, tokens, state, out_shardings):
  logits, state = nnx.merge(graphdef, params).step(tokens, state)
  token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return token, jax.lax.with_sharding_constraint(state, out_shardings.tree)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _sharded_step_logits(graphdef, params, tokens, state, out_shardings, whole):
  logits, state = nnx.merge(graphdef, params).step(tokens, state)
  return (jax.lax.with_sharding_constraint(logits.astype(jnp.float32), whole),
          jax.lax.with_sharding_constraint(state, out_shardings.tree))


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _sharded_prefill_logits(graphdef, params, tokens, state, n_valid, out_shardings, whole):
  logits, state = nnx.merge(graphdef, params).prefill(tokens, state, n_valid)
  last = logits[jnp.arange(logits.shape[0]), n_valid - 1].astype(jnp.float32)
  return (jax.lax.with_sharding_constraint(last, whole),
          jax.lax.with_sharding_constraint(state, out_shardings.tree))


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def sharded_probe_logits(graphdef, params, tokens, state, capacity, whole):
  logits, _ = nnx.merge(graphdef, params).step(tokens, state.grow(capacity))
  return jax.lax.with_sharding_constraint(logits.astype(jnp.float32), whole)


def _host_scalar(x: jax.Array) -> np.ndarray:
  return np.asarray(x.addressable_data(0))


def region_prefill(model: Model, mesh: Mesh, prompt: Sequence[int], capacity: int | None = None,
                   barrier=_no_barrier) -> tuple[int, DecodeState]:
  """Greedy prefill of one prompt on the whole region (every process calls it;
  pass the region's ``Barrier`` when it has several processes).

  Returns:
    (first generated token, the ``DecodeState`` sharded by ``state_shardings``).
  """
  config = model.config
  prompt = np.asarray(prompt, np.int32)
  seq = len(prompt)
  capacity = capacity or round_up(seq)
  shardings = state_shardings(config, mesh, 1, capacity)
  tokens = np.zeros((1, prefill_bucket(seq)), np.int32)
  tokens[0, :seq] = prompt
  state = empty_state(config, 1, capacity, shardings)
  token, state = synchronized_call(
      _sharded_prefill, (0, 5),
      (model.graphdef, model.params, replicated(mesh, tokens), state,
       replicated(mesh, np.array([seq], np.int32)), StaticShardings(shardings)),
      barrier, "prefill")
  return int(_host_scalar(token)[0]), state


def region_prefill_logits(model: Model, mesh: Mesh, prompt: Sequence[int],
                          barrier=_no_barrier, capacity: int | None = None
                          ) -> tuple[np.ndarray, DecodeState]:
  """``region_prefill`` that returns the last prompt position's logits instead of
  a greedy token (the caller samples: the serving path's sampling and logprobs).

  The state's capacity is ``capacity`` or else the padded prompt's
  (``round_up(prefill_bucket(n))``), so a pod compiles one prefill program per
  bucket, not one per 64 tokens of prompt; the codec sends only the first
  ``n`` positions anyway. A decode slice that prefills locally passes the
  capacity its decode needs.

  Returns:
    (logits f32 [vocab], identical on every process; the batch-1 ``DecodeState``
    sharded by ``state_shardings``).
  """
  config = model.config
  prompt = np.asarray(prompt, np.int32)
  seq = len(prompt)
  capacity = max(capacity or 0, round_up(prefill_bucket(seq)))
  shardings = state_shardings(config, mesh, 1, capacity)
  tokens = np.zeros((1, prefill_bucket(seq)), np.int32)
  tokens[0, :seq] = prompt
  state = empty_state(config, 1, capacity, shardings)
  logits, state = synchronized_call(
      _sharded_prefill_logits, (0, 5, 6),
      (model.graphdef, model.params, replicated(mesh, tokens), state,
       replicated(mesh, np.array([seq], np.int32)), StaticShardings(shardings),
       NamedSharding(mesh, PartitionSpec())),
      barrier, "prefill_logits")
  return np.asarray(logits.addressable_data(0))[0], state


def region_probe_logits(model: Model, mesh: Mesh, state: DecodeState, token: int,
                        capacity: int, barrier=_no_barrier) -> np.ndarray:
  """Logits f32 [vocab] of one decode step of the sharded batch-1 ``state`` fed
  ``token``, the state grown to ``capacity`` first (``logit_probe.probe_logits``
  on a region; every process calls it; ``state`` is not modified)."""
  logits = synchronized_call(
      sharded_probe_logits, (0, 4, 5),
      (model.graphdef, model.params, replicated(mesh, np.array([token], np.int32)), state,
       int(capacity), NamedSharding(mesh, PartitionSpec())), barrier, "probe")
  return np.asarray(logits.addressable_data(0))[0]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _damaged_state(state, kinds, length, out_shardings):
  return jax.lax.with_sharding_constraint(sensitivity.damage_traced(state, kinds, length),
                                          out_shardings.tree)


def region_damage(config: ModelConfig, state: DecodeState, length: int,
                  barrier=_no_barrier) -> DecodeState:
  """The sharded batch-1 ``state`` of a ``length``-token prompt damaged as
  ``sensitivity.damage`` damages one process's (fault injection: every
  process calls it), in the same shardings."""
  shardings = StaticShardings(jax.tree_util.tree_map(lambda x: x.sharding, state))
  return synchronized_call(_damaged_state, (1, 2, 3),
                           (state, tuple(config.layer_kinds), int(length), shardings),
                           barrier, "damage")


def region_step(model: Model, mesh: Mesh, state: DecodeState, token: int,
                barrier=_no_barrier) -> tuple[int, DecodeState]:
  """One greedy decode step of a batch-1 state on the whole region."""
  shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
  token, state = synchronized_call(
      _sharded_step, (0, 4),
      (model.graphdef, model.params, replicated(mesh, np.array([token], np.int32)), state,
       StaticShardings(shardings)), barrier, "step")
  return int(_host_scalar(token)[0]), state


def region_step_logits(model: Model, mesh: Mesh, state: DecodeState, token: int,
                       barrier=_no_barrier) -> tuple[np.ndarray, DecodeState]:
  """One decode step of a batch-1 state on the whole region, fed ``token``.

  Returns:
    (logits f32 [vocab], identical on every process, so every process samples
    the same next token; the new state, sharded as ``state``).
  """
  shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
  logits, state = synchronized_call(
      _sharded_step_logits, (0, 4, 5),
      (model.graphdef, model.params, replicated(mesh, np.array([token], np.int32)), state,
       StaticShardings(shardings), NamedSharding(mesh, PartitionSpec())),
      barrier, "step_logits")
  return np.asarray(logits.addressable_data(0))[0], state


def synthetic_state(config: ModelConfig, mesh: Mesh, capacity: int, seed: int = 0
                    ) -> DecodeState:
  """A full batch-1 state of random values (``lengths = capacity``), placed by
  ``state_shardings``: the same state for any mesh and process count, for
  measuring transfers without a prefill."""
  like = abstract_state(config, 1, capacity)

  def make():
    leaves, treedef = jax.tree_util.tree_flatten(like)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, x.dtype)
           for k, x in zip(keys, leaves)]
    state = jax.tree_util.tree_unflatten(treedef, out)
    return state.replace(lengths=jnp.full((1,), capacity, jnp.int32))

  return jax.jit(make, out_shardings=state_shardings(config, mesh, 1, capacity))()


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum(bits[i] * (2 i + 1)) mod 2**32 over the flat index i: exact in any
  reduction order (integer arithmetic), so equal for any mesh, and sensitive
  to moved values, not only to changed ones."""
  if x.dtype.itemsize not in (1, 2, 4):
    raise ValueError(f"no checksum for dtype {x.dtype}")
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride)
    stride = (stride * x.shape[axis]) % (1 << 32)
  return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _checksums(state):
  return jax.tree_util.tree_map(_leaf_checksum, state)


def state_checksum(state: Any, barrier=_no_barrier) -> dict[str, int]:
  """Leaf name -> ``_leaf_checksum`` (every process of the region calls it;
  each reads the replicated result)."""
  sums = synchronized_call(_checksums, (), (state,), barrier, "checksum")
  return {n: int(_host_scalar(x)) for n, x in layout.named_leaves(sums)}


class StaticShardings:
  """A shardings pytree usable as a static jit argument (hashed by value)."""

  def __init__(self, tree):
    self.tree = tree
    leaves, self._treedef = jax.tree_util.tree_flatten(tree)
    self._key = (self._treedef, tuple(leaves))

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, StaticShardings) and self._key == other._key
