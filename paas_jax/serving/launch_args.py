"""Command lines of a deployment's processes, from a ``ClusterSpec`` (pure).

``LocalCluster`` (child processes) and ``RayCluster`` (Ray actors) start the
same command lines; only the hosts differ. Region A is one prefill server;
each decode region (B, C, ...) has its PD nodes, a WAN relay when its link is
emulated, and its own broker, which asks region A for prefill as tenant
``B``, ``C``, ... when one region-A pool serves several decode regions.
"""

from __future__ import annotations

from typing import Sequence

from paas_jax.netem.link import LinkSpec
from paas_jax.serving import pd_roles, transfer_flags


def _shaped(link: LinkSpec | None) -> bool:
  """Whether ``link`` emulates a finite rate."""
  return link is not None and 0 < link.bandwidth_bps < float("inf")


def link_bps(link: LinkSpec | None) -> float:
  """The link capacity a broker's router assumes (no emulation: 10 Gbps)."""
  if not _shaped(link):
    return 10e9
  return float(link.bandwidth_bps)


def widest_link(spec) -> LinkSpec | None:
  """Of the emulated links from region A (``spec.link``, ``spec.region_links``),
  the one with the largest bandwidth-delay product: region A's socket buffers
  must fit the longest pipe (more than a shorter one needs costs nothing but
  memory). None without a shaped link."""
  links = [link for link in (spec.link, *spec.region_links) if _shaped(link)]
  return max(links, key=lambda link: link.bandwidth_bps * link.rtt_s, default=None)


def server_args(spec, host: str) -> list[str]:
  """Flags both the prefill and the decode servers take."""
  args = [f"--config={spec.config}", f"--seed={spec.seed}", f"--host={host}", "--port=0",
          f"--max_ctx={spec.max_ctx}", f"--prefill_max_batch={spec.prefill_max_batch}",
          f"--prefill_buckets={','.join(str(b) for b in spec.prefill_buckets)}",
          f"--batch_window_ms={spec.batch_window_ms}", f"--log_level={spec.log_level}",
          f"--prefix_block={spec.prefix_block}", f"--logit_probe={spec.logit_probe}"]
  if spec.checkpoint:
    args.append(f"--checkpoint={spec.checkpoint}")
  if spec.dtype:
    args.append(f"--dtype={spec.dtype}")
  if spec.tp != 1:
    args.append(f"--tp={spec.tp}")
  if spec.compilation_cache is not None:
    args.append(f"--compilation_cache={spec.compilation_cache}")
  return args


def prefill_args(spec, host: str) -> list[str]:
  """Region A's prefill server (without the security/metrics flags)."""
  # A decode slice takes a pod's per-process parts: region A of one process
  # then runs as a pod of one (pod_prefill_server), not as the prefill server.
  as_pod = spec.prefill_pod > 1 or spec.decode_slice > 1
  module = "pod_prefill_server" if as_pod else "prefill_server"
  args = ["-m", f"paas_jax.serving.{module}", *server_args(spec, host),
          f"--codec_compression={spec.codec_compression}",
          f"--transfer_streams={spec.transfer_streams}",
          f"--transfer_plane={'grpc' if spec.flaky_wan else spec.transfer_plane}",
          f"--transfer_lanes={spec.transfer_lanes}",
          # Imports PD-P's prefixes (cross-cluster prefix cache); explicit so
          # that a restart keeps the port the relay forwards to.
          "--transfer_port=0"]
  widest = widest_link(spec)
  if widest is not None:  # the data plane sized for the emulated path
    args += transfer_flags.link_args(widest.bandwidth_bps, widest.rtt_s)
  if spec.decode_regions > 1:  # a shared pool: how the tenants share it
    args += [f"--tenant_sharing={spec.tenant_sharing}",
             f"--tenant_weights={spec.tenant_weights}",
             f"--tenant_quota={spec.tenant_quota}"]
  if spec.prefill_faults:
    args.append(f"--faults={spec.prefill_faults}")
  if as_pod:  # region A as a pod of processes (pod_prefill_server)
    args += [f"--pod_processes={spec.prefill_pod}",
             f"--pod_devices={spec.prefill_pod_devices}"]
    if spec.prefill_pod_fault:
      args.append(f"--pod_fault={spec.prefill_pod_fault}")
  return args + list(spec.prefill_args)


def check_decode_slice(spec) -> None:
  """Raises ``ValueError`` for a decode slice in a deployment it does not fit."""
  if spec.decode_slice < 1 or spec.decode_slice_devices < 1:
    raise ValueError(f"decode_slice ({spec.decode_slice}) and decode_slice_devices "
                     f"({spec.decode_slice_devices}) must be >= 1")
  slice_nodes = spec.slice_nodes
  if slice_nodes < 1:
    raise ValueError(f"slice_nodes must be >= 1 (PD nodes 0 .. slice_nodes - 1 are the "
                     f"slices), got slice_nodes={slice_nodes}")
  if slice_nodes > 1 and spec.decode_slice < 2:
    # Without a slice every PD node is one process: slice_nodes would say nothing.
    raise ValueError(f"slice_nodes={slice_nodes} needs decode_slice > 1 (the processes of "
                     f"each slice), got decode_slice={spec.decode_slice}")
  if slice_nodes > spec.pd_nodes:
    raise ValueError(f"slice_nodes={slice_nodes} slices need as many PD nodes: "
                     f"pd_nodes={spec.pd_nodes}")
  if spec.decode_slice == 1:
    return
  unfit = {"prefill_faults (a slice's region A runs as a pod)": bool(spec.prefill_faults)}
  named = [k for k, v in unfit.items() if v]
  if named:
    raise ValueError(f"a decode slice (decode_slice={spec.decode_slice}) is launched without "
                     f"{', '.join(named)}")
  # The slices (nodes 0 .. slice_nodes - 1) are always "both"; pd_prefill_nodes
  # splits the other (single-process) nodes as the broker will (pd_roles).
  try:
    pd_roles.default_roles_for(pd_node_shapes(spec), spec.pd_prefill_nodes)
  except pd_roles.RoleError as e:
    raise ValueError(f"pd_prefill_nodes={spec.pd_prefill_nodes} with {slice_nodes} decode "
                     f"slice(s) among pd_nodes={spec.pd_nodes}: {e}") from None


def pd_node_shapes(spec) -> list:
  """Each PD node's ``pd_roles.NodeShape``: with a decode slice, nodes 0 ..
  ``slice_nodes`` - 1 ("decode", "decode1", ...) are slices and the others
  single decode processes."""
  slices = spec.slice_nodes if spec.decode_slice > 1 else 0
  return [pd_roles.SLICE if i < slices else pd_roles.SINGLE
          for i in range(max(spec.pd_nodes, 1))]


def slice_tls_names(spec, node: int = 0) -> list[str]:
  """The certificates of PD node ``node``'s slice processes (``--slice_tls_names``),
  one per process so that each holds only its own key; [] for a single node or
  without TLS. Node 0 keeps ``decode-slice<q>``, node n takes
  ``decode<n>-slice<q>``: both match the decode peer patterns (``decode*``)."""
  if not spec.tls or pd_node_shapes(spec)[node] is not pd_roles.SLICE:
    return []
  stem = "decode" if node == 0 else f"decode{node}"
  return [f"{stem}-slice{q}" for q in range(spec.decode_slice)]


def all_slice_tls_names(spec) -> list[str]:
  """Every slice process's certificate, over all PD nodes (the launcher makes them)."""
  return [n for node in range(max(spec.pd_nodes, 1)) for n in slice_tls_names(spec, node)]


def decode_args(spec, host: str, data_plane_host: str | None, node: int = 0) -> list[str]:
  """PD node ``node`` (a decode server). ``data_plane_host``: bind the data
  plane there (a relay takes the announced port on the address region A dials)."""
  if pd_node_shapes(spec)[node] is pd_roles.SLICE:  # a slice of processes (nodes 0 ..)
    # Behind a relay (data_plane_host) every slice process's data plane binds
    # there; the relay forwards each one's announced port (launch_routes).
    names = slice_tls_names(spec, node)
    return ["-m", "paas_jax.serving.slice_decode_server", *server_args(spec, host),
            "--transfer_port=0", f"--max_queue={spec.max_queue}",
            f"--transfer_plane={spec.transfer_plane}",
            *([f"--data_plane_host={data_plane_host}"] if data_plane_host else []),
            f"--slice_slots={spec.n_slots}", f"--slice_processes={spec.decode_slice}",
            f"--slice_devices={spec.decode_slice_devices}",
            *([f"--slice_tls_names={','.join(names)}"] if names else []),
            *([f"--faults={spec.decode_faults}"] if spec.decode_faults else []),
            *spec.decode_args]
  args = ["-m", "paas_jax.serving.decode_server", *server_args(spec, host),
          "--transfer_port=0", f"--n_slots={spec.n_slots}", f"--page_size={spec.page_size}",
          f"--num_pages={spec.num_pages}", f"--max_queue={spec.max_queue}",
          f"--transfer_plane={spec.transfer_plane}"]
  if spec.decode_faults:
    args.append(f"--faults={spec.decode_faults}")
  if data_plane_host:
    args.append(f"--data_plane_host={data_plane_host}")
  return args + list(spec.decode_args)


def relay_args(link: LinkSpec, stats_file, routes: Sequence[str],
               engine: str = "asyncio") -> list[str]:
  """The WAN relay of one decode region's link (``routes``: its --route values;
  ``engine``: its forwarding, netem's --engine)."""
  bw = link.bandwidth_bps if link.bandwidth_bps < float("inf") else 0
  args = ["-m", "paas_jax.netem", f"--bandwidth={bw}", f"--rtt_ms={link.rtt_s * 1e3}",
          f"--jitter_ms={link.jitter_s * 1e3}", f"--shape_bandwidth={link.shape_bandwidth}",
          f"--seed={link.seed}", f"--stats_file={stats_file}", f"--engine={engine}",
          *[f"--route={r}" for r in routes]]
  if link.trace is not None:
    trace = ",".join(f"{t}:{r}" for t, r in link.trace.points)
    if link.trace.loop:
      trace += f",period={link.trace.period}"
    args.append(f"--trace={trace}")
  return args


def broker_args(spec, *, host: str, link: LinkSpec | None, prefill_target: str,
                prefix_target: str, pd_control: Sequence[str], pd_wan: Sequence[str],
                pd_local: Sequence[str], tenant: str) -> list[str]:
  """One decode region's broker (without the security/metrics flags)."""
  args = ["-m", "paas_jax.serving.broker", f"--config={'' if spec.checkpoint else spec.config}",
          "--port=0", f"--host={host}",
          f"--prefill={prefill_target}", f"--prefill_transfer={prefix_target}",
          f"--decode={','.join(pd_control)}", f"--decode_transfer={','.join(pd_wan)}",
          f"--decode_local_transfer={','.join(pd_local)}",
          f"--pd_prefill_nodes={spec.pd_prefill_nodes}",
          f"--rebalance_apply={spec.rebalance_apply}", f"--threshold={spec.threshold}",
          f"--log_level={spec.log_level}", f"--router={spec.router}",
          f"--n_slots={spec.n_slots}", f"--rebalance_every_s={spec.rebalance_every_s}",
          f"--link_bandwidth_bps={link_bps(link)}"]
  if tenant:
    args.append(f"--tenant={tenant}")
  if spec.checkpoint:  # its tokenizer, chat template, EOS ids and name
    args.append(f"--checkpoint={spec.checkpoint}")
  if spec.served_model_name:
    args.append(f"--served_model_name={spec.served_model_name}")
  return args
