"""A decode region's WAN relay routes and the broker's ``--decode_transfer``
entries, per PD node (pure; ``launch.LocalCluster._start_front``).

Every PD node's process 0 gets its StateTransfer route (``transfer`` for node 0,
``transfer<n>``) and, on the TCP data plane, its data plane (``dataplane<n>``).
A node that is a decode slice also gets one route per other process q >= 1:
``slice<q>`` / ``slicedataplane<q>`` for node 0 (the names from before several
slices) and ``node<n>slice<q>`` / ``node<n>slicedataplane<q>`` for node n, so
that no two slices share a route. A slice's ``--decode_transfer`` entry lists
its processes' addresses joined by ``+`` (``node_pool.DecodeTarget.parse``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from paas_jax.serving import pd_roles


def slice_route_names(node: int, q: int) -> tuple[str, str]:
  """(StateTransfer route, data-plane route) of PD node ``node``'s slice process
  ``q`` (q >= 1; process 0 is reached on the node's own routes)."""
  if q < 1:
    raise ValueError(f"slice process {q}: process 0 takes the node's own routes")
  if node == 0:  # kept: tests and tools read node 0's routes by these names
    return f"slice{q}", f"slicedataplane{q}"
  return f"node{node}slice{q}", f"node{node}slicedataplane{q}"


def slice_others(shape: pd_roles.NodeShape, info: Mapping) -> list[str]:
  """The StateTransfer addresses of a slice's processes 1, 2, ... from its
  ready file (``slice_transfer`` lists process 0 first); [] for a single node."""
  if shape is not pd_roles.SLICE:
    return []
  others = list(info.get("slice_transfer", []))[1:]
  if not others:
    raise ValueError("a decode slice's ready file lists no other process's transfer port")
  return others


def relay_routes(shapes: Sequence[pd_roles.NodeShape], pd_info: Sequence[Mapping], *,
                 dial: str, local: str, transfer_target: str, control_target: str,
                 prefix_target: str, local_transfer: Sequence[str], tcp: bool,
                 data_plane_host: str) -> list[str]:
  """The relay's ``--route`` values: region A's transfers to every PD node
  (and every slice process), the broker's control and PD-P's prefixes to A.
  ``dial``: where region A reaches the relay; ``local``: where region B does."""
  routes = [f"transfer={dial}:0->{transfer_target}@a_to_b",
            f"control={local}:0->{control_target}@b_to_a",
            f"prefix={local}:0->{prefix_target}@b_to_a"]
  # Data planes of the PD nodes, over the same link, on the port they announce.
  for i, d in enumerate(pd_info):
    if d.get("data_plane_port") and tcp:
      dp = d["data_plane_port"]
      routes.append(f"dataplane{i}={dial}:{dp}->{data_plane_host}:{dp}@a_to_b")
  # The other PD nodes' StateTransfer ports, over the same link (PrfaaS states).
  routes += [f"transfer{i}={dial}:0->{local_transfer[i]}@a_to_b"
             for i in range(1, len(pd_info))]
  # Each slice's other processes' StateTransfer ports and data planes (each
  # process binds its data plane at a port its supervisor fixed for the slice's
  # lifetime, pod_supervisor: on data_plane_host, or on its own node's address
  # when it runs on another node than the relay, ray_pods).
  for node, (shape, d) in enumerate(zip(shapes, pd_info)):
    others = slice_others(shape, d)
    for q, address in enumerate(others, 1):
      routes.append(f"{slice_route_names(node, q)[0]}={dial}:0->{address}@a_to_b")
    if others and tcp:
      ports = d["slice_data_plane_ports"]
      hosts = d.get("slice_data_plane_hosts") or [data_plane_host] * len(ports)
      for q in range(1, len(ports)):
        routes.append(f"{slice_route_names(node, q)[1]}={dial}:{ports[q]}->"
                      f"{hosts[q]}:{ports[q]}@a_to_b")
  names = [r.split("=", 1)[0] for r in routes]
  if len(set(names)) != len(names):  # the relay keys its ports by route name
    raise ValueError(f"relay routes share a name: {sorted(names)}")
  return routes


def direct_entries(shapes: Sequence[pd_roles.NodeShape], pd_info: Sequence[Mapping],
                   node0_transfer: str, local_transfer: Sequence[str]) -> list[str]:
  """``--decode_transfer`` without a relay: node 0 at ``node0_transfer`` (a
  FlakyLink may sit there), the others at their own ports; a slice's entry
  adds its other processes' addresses."""
  firsts = [node0_transfer, *local_transfer[1:]]
  return ["+".join([first, *slice_others(shape, d)])
          for first, shape, d in zip(firsts, shapes, pd_info)]


def relayed_entries(shapes: Sequence[pd_roles.NodeShape], pd_info: Sequence[Mapping],
                    ports: Mapping[str, int], dial: str) -> list[str]:
  """``--decode_transfer`` behind the relay: every address is a relay port."""
  out = []
  for node, (shape, d) in enumerate(zip(shapes, pd_info)):
    first = f"{dial}:{ports['transfer' if node == 0 else f'transfer{node}']}"
    out.append("+".join([first] + [f"{dial}:{ports[slice_route_names(node, q)[0]]}"
                                   for q in range(1, len(slice_others(shape, d)) + 1)]))
  return out
