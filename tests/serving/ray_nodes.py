"""A local multi-node Ray cluster on this machine with region-labelled nodes.

A head node without CPUs (it only runs the GCS), one node with the custom
resource ``region_a`` and one with ``region_b``: the processes of each region
must land on their own node. Further nodes of a region may be added on their
own loopback addresses (``127.0.0.x``), so that, as on separate machines, no
two of them bind the same address. Small footprint (no dashboard, 80 MiB
object stores): the test machine has 2 cores.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
import warnings

import ray
from ray.cluster_utils import Cluster

_STORE = 80 * 1024 * 1024


# Ray waits a fixed 30 s for a new raylet to register with the GCS; on 2 busy
# cores (the other pytest worker compiling) a node can miss that, so starting
# the cluster is retried (a fresh cluster each time) before the test errors.
_START_ATTEMPTS = 3


def _start(regions: tuple[str, ...], more: dict[str, tuple[str, ...]]):
  cluster = Cluster(initialize_head=True,
                    head_node_args=dict(num_cpus=0, include_dashboard=False,
                                        object_store_memory=_STORE))
  try:
    nodes = {r: cluster.add_node(num_cpus=2 if r == "a" else 4, resources={f"region_{r}": 1},
                                 object_store_memory=_STORE)
             for r in regions}
    for r, addresses in more.items():
      for i, address in enumerate(addresses, 1):
        nodes[f"{r}{i}"] = cluster.add_node(num_cpus=2, resources={f"region_{r}": 1},
                                            object_store_memory=_STORE,
                                            node_ip_address=address)
  except Exception:
    cluster.shutdown()
    raise
  return cluster, nodes


@contextlib.contextmanager
def labelled_ray_cluster(regions: tuple[str, ...] = ("a", "b"),
                         more: dict[str, tuple[str, ...]] | None = None):
  """Yields (cluster, {region: node id}) with ray.init() connected: one node
  per region letter, carrying the custom resource ``region_<letter>``.
  ``more``: further nodes of a region, one per address given (keys ``b1``,
  ``b2``, ... in the dict yielded)."""
  for attempt in range(1, _START_ATTEMPTS + 1):
    try:
      cluster, nodes = _start(regions, more or {})
      break
    except Exception as e:  # pylint: disable=broad-except  (Ray raises a bare Exception)
      if "timed out during startup" not in str(e) or attempt == _START_ATTEMPTS:
        raise
      warnings.warn(f"Ray node start timed out (attempt {attempt}); starting a fresh cluster")
  try:
    ray.init(address=cluster.address, log_to_driver=False, namespace="paas_jax_tests")
    cluster.wait_for_nodes()
    yield cluster, {r: n.node_id for r, n in nodes.items()}
  finally:
    if ray.is_initialized():
      ray.shutdown()
    cluster.shutdown()


def process_alive(pid: int) -> bool:
  """Whether a process (a server a Ray actor ran) still runs on this machine (a
  zombie, dead but not yet reaped by whoever inherited it, does not)."""
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return False
  return state not in ("Z", "X")


def process_gone(pid: int, timeout_s: float = 30.0) -> bool:
  """Whether the process is gone within ``timeout_s``: a killed actor's server
  dies by its parent-death signal, which takes a moment to arrive and act."""
  deadline = time.monotonic() + timeout_s
  while process_alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)
  return True
