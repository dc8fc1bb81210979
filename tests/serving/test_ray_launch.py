"""The Ray launcher: region placement, supervision and restarts (real Ray nodes).

Runs a light real process (the WAN relay) under the launcher's actors on a
two-node Ray cluster with ``region_a`` / ``region_b`` resources; the whole
two-region serving path on Ray is in test_ray_e2e.py (slow).
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import ray

from paas_jax.netem import LinkSpec
from paas_jax.serving.child_process import LaunchError
from paas_jax.serving.launch import ClusterSpec
from paas_jax.serving.pod_launch import PodFailure
from paas_jax.serving.pod_ray import PodPlacement, run_ray
from paas_jax.serving.ray_launch import RayCluster, RayPlacement, restart_args

from tests.serving.ray_nodes import labelled_ray_cluster, process_gone
from tests.serving.test_pod import pod_config


def test_restart_args_pin_ports_and_drop_the_fault_plan():
  args = ["-m", "x", "--port=0", "--transfer_port=0", "--faults=kill_after_layers=2",
          "--host=10.0.0.2"]
  assert restart_args(args, {"--port": 5001, "--transfer_port": 5002}) == [
      "-m", "x", "--port=5001", "--transfer_port=5002", "--host=10.0.0.2"]
  # A port the first run did not report stays as it was.
  assert restart_args(["--port=0"], {"--port": None}) == ["--port=0"]


@pytest.fixture(scope="module")
def ray_nodes():
  with labelled_ray_cluster() as (cluster, nodes):
    yield cluster, nodes


def _echo_server():
  """A TCP echo server standing in for a region's port behind the relay."""
  sock = socket.socket()
  sock.bind(("0.0.0.0", 0))
  sock.listen()

  def serve():
    while True:
      try:
        conn, _ = sock.accept()
      except OSError:
        return
      with conn:
        data = conn.recv(1024)
        conn.sendall(data)

  threading.Thread(target=serve, daemon=True).start()
  return sock


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("0.0.0.0", 0))
    return s.getsockname()[1]


def _roundtrip(host: str, port: int, payload: bytes, timeout_s: float = 20.0) -> bytes:
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(1024)
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.2)


def test_regions_land_on_their_nodes_and_a_killed_actor_comes_back(ray_nodes, tmp_path):
  _, nodes = ray_nodes
  spec = ClusterSpec(link=LinkSpec(bandwidth_bps=1e9, rtt_s=0.002), tls=True)
  cluster = RayCluster(spec, tmp_path, RayPlacement(address="auto", cpus_per_server=1,
                                                     max_restarts=2))
  echo = _echo_server()
  try:
    a_host, b_host = cluster._place()  # pylint: disable=protected-access
    assert cluster.nodes == nodes  # region A on the region_a node, B on region_b
    port = _free_port()
    relay_args = ["-m", "paas_jax.netem", "--bandwidth=0", "--rtt_ms=1",
                  f"--stats_file={cluster.relay_stats_file}",
                  f"--route=probe={b_host}:{port}->{a_host}:{echo.getsockname()[1]}@a_to_b"]
    proc = cluster._spawn("relay", relay_args, "b")  # pylint: disable=protected-access
    cluster.procs["relay"] = proc
    deadline = time.monotonic() + 120
    while not proc.poll_ready():
      assert time.monotonic() < deadline
      time.sleep(0.1)
    first = proc.info
    assert first["node_id"] == nodes["b"] and first["restarts"] == 0
    assert _roundtrip(b_host, port, b"hello") == b"hello"

    # The actor's process is killed (a preempted worker): the server goes with it
    # and Ray restarts the actor, which serves on the same port again.
    ray.kill(proc.actor, no_restart=False)
    second = cluster.wait_restarted("relay", 120)
    assert second["restarts"] == 1 and second["pid"] != first["pid"]
    assert process_gone(first["pid"])
    assert second["node_id"] == nodes["b"]
    assert _roundtrip(b_host, port, b"again") == b"again"

    # The server itself dies: its actor exits and comes back too.
    assert proc.popen.poll() is None  # still running
    proc.popen.kill()
    third = cluster.wait_restarted("relay", 120)
    assert third["restarts"] == 2 and third["pid"] != second["pid"]
    assert _roundtrip(b_host, port, b"third") == b"third"
    # Read on region B's node through its actor; the relay rewrites the file
    # every 0.5 s, so a just-restarted one may not have written it yet.
    deadline = time.monotonic() + 30
    while cluster.relay_stats() is None:
      assert time.monotonic() < deadline, "no relay statistics from region B's node"
      time.sleep(0.5)
  finally:
    cluster.stop()
    echo.close()
  assert process_gone(third["pid"])
  assert not cluster.groups


def test_a_region_without_a_node_fails_clearly(ray_nodes, tmp_path):
  # Negative control for placement: no node carries "region_z".
  cluster = RayCluster(ClusterSpec(), tmp_path,
                       RayPlacement(address="auto", region_a_resource="region_z",
                                    placement_timeout_s=3))
  try:
    with pytest.raises(LaunchError, match="region A's placement group"):
      cluster._place()  # pylint: disable=protected-access
  finally:
    cluster.stop()


def test_a_pod_that_does_not_fit_is_refused_whole(ray_nodes):
  # Gang scheduling (pod_ray): a 3-process pod needs 3 CPUs, region_a has 2.
  del ray_nodes
  with pytest.raises(PodFailure) as e:
    run_ray(pod_config("tiny_gdn_gqa"), [1, 2, 3], pod_processes=3, pod_devices=1,
            slice_processes=1, slice_devices=1, max_new_tokens=2,
            placement=PodPlacement(cpus_per_process=1, placement_timeout_s=3))
  assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "nothing was started" in str(e.value)


def test_a_prefill_pod_gets_one_bundle_per_process_or_none(ray_nodes, tmp_path):
  # A pod of 2 (ray_pods: an actor per process) is one group of 2 bundles on the
  # region_a node; a pod of 3 needs 3 CPUs there (it has 2): nothing is placed.
  _, nodes = ray_nodes
  cluster = RayCluster(ClusterSpec(prefill_pod=2), tmp_path, RayPlacement(address="auto"))
  try:
    cluster._place()  # pylint: disable=protected-access
    assert len(cluster.groups["a"].bundle_specs) == 2 and cluster.nodes["a"] == nodes["a"]
  finally:
    cluster.stop()
  cluster = RayCluster(ClusterSpec(prefill_pod=3), tmp_path,
                       RayPlacement(address="auto", placement_timeout_s=3))
  try:
    with pytest.raises(LaunchError, match="region A's placement group"):
      cluster._place()  # pylint: disable=protected-access
  finally:
    cluster.stop()
