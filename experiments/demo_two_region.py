r"""Two-region PrfaaS demo: prefill in region A, decode in region B, over a WAN link.

  .venv/bin/python experiments/demo_two_region.py            # defaults just run
  .venv/bin/python experiments/demo_two_region.py --num_requests=32 --bandwidth=20mbit \
      --trace="0:50mbit,3:5mbit,6:50mbit" --netem=netns --json_out=runs/demo/report.json

Starts, as separate OS processes, the prefill server (region A, PrfaaS), the
decode server (region B: continuous-batching decode plus local PD-P
prefill), the WAN relay between them (bandwidth, RTT, jitter, bandwidth over
time; with --netem=netns region A also lives in its own network namespace
with tbf shaping) and the broker. It then sends a workload whose prompt
lengths follow the paper's truncated log-normal (mu=9.90, sigma=1.00 on
[128, 128K]) scaled to the model's context; the broker routes each request by
the selective-offloading rule (l > t: PrfaaS, else PD-P). Finally it checks
every request's tokens against single-process ``api.generate`` with the same
prompt, sampling settings and seed, and prints and writes a report.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.demo_options import resolve_pools  # noqa: E402
from experiments.demo_summary import print_summary  # noqa: E402
from experiments.demo_workload import (PAPER_T, compute_reference, inject_fault,  # noqa: E402
                                       link_report, make_workload, run_workload,
                                       server_stats, summarize)
from paas_jax.netem import (BandwidthTrace, LinkSpec, describe,  # noqa: E402
                            netns_available, parse_rate)
from paas_jax.netem.splice_relay import default_engine  # noqa: E402
from paas_jax.serving.launch import ClusterSpec, LocalCluster  # noqa: E402
from paas_jax.serving import tenant_report  # noqa: E402
from paas_jax.serving.ray_launch import RayCluster, RayPlacement  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config (random init, shared seed).")
flags.DEFINE_string("checkpoint", None, "Serve this checkpoint (HF or paas-jax) instead of "
                    "--config: its weights, tokenizer, chat template, EOS ids and name.")
flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"], "Serving dtype (bfloat16: weights, "
                  "activations, KV in bf16; recurrent states f32).")
flags.DEFINE_integer("http_port", -1, "Also start the OpenAI-compatible gateway on this port "
                     "(0: any free port, -1: off).")
flags.DEFINE_integer("seed", 0, "Weight seed shared by every process; also the workload seed.")
flags.DEFINE_integer("num_requests", 16, "Requests in the workload.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated per request.")
flags.DEFINE_float("rate", 6.0, "Poisson arrival rate (requests/s).")
flags.DEFINE_integer("context", 1024, "Context per request (prompt + output), <= max_seq_len.")
flags.DEFINE_float("threshold", -1.0, "Offload threshold t in tokens (-1: the paper's 19.4K "
                   "scaled like the prompt lengths).")
flags.DEFINE_float("length_mu", 9.90, "Log-normal mu of prompt lengths (paper, at 128K scale).")
flags.DEFINE_float("length_sigma", 1.00, "Log-normal sigma.")
flags.DEFINE_string("bandwidth", "50mbit", "Link bandwidth between the regions.")
flags.DEFINE_string("trace", "0:50mbit,4:8mbit,6:50mbit,period=10",
                    "Bandwidth over time ('t:rate,...[,period=s]', a .json, or '' for constant).")
flags.DEFINE_float("rtt_ms", 20.0, "Link round-trip time.")
flags.DEFINE_float("jitter_ms", 2.0, "Standard deviation of the one-way delay.")
flags.DEFINE_enum("netem", "relay", ["relay", "netns", "auto"],
                  "relay: userspace relay (anywhere); netns: region A in a network namespace "
                  "with tbf shaping plus the relay for delay (root); auto: netns if possible.")
flags.DEFINE_enum("relay_engine", default_engine(), ["asyncio", "splice"],
                  "The relay's forwarding: asyncio (portable) or splice (Linux, in the "
                  "kernel; for fast links).")
flags.DEFINE_integer("n_slots", 8, "Decode slots in region B.")
flags.DEFINE_integer("pd_nodes", 1, "PD nodes (decode servers) in region B; > 1 splits them into "
                     "PD-P and PD-D roles (report: routing.router.roles / role_moves).")
flags.DEFINE_bool("rebalance_apply", False, "Let the broker apply the rebalancer: t and, with "
                  "--pd_nodes > 1, PD node roles.")
flags.DEFINE_integer("max_queue", 64, "Requests allowed to wait for a decode slot.")
flags.DEFINE_list("prefill_buckets", ["64", "256"], "Prefill chunk buckets (largest = chunk).")
flags.DEFINE_enum("codec", "raw", ["raw", "zstd", "blosc"], "State codec on the link.")
flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "What carries state bytes A->B: "
                  "the TCP data plane (default) or gRPC Push streams (the old path).")
flags.DEFINE_bool("reference", True, "Check tokens against single-process generation.")
flags.DEFINE_string("json_out", "runs/demo/report.json", "Where to write the JSON report.")
flags.DEFINE_string("workdir", "runs/demo", "Logs and readiness files of the processes.")
flags.DEFINE_string("compilation_cache", None, "XLA compilation cache (default "
                    "$PAAS_JAX_COMPILATION_CACHE or runs/.jax_cache; 'none': off).")
flags.DEFINE_bool("progress", True, "Show progress bars.")
flags.DEFINE_enum("router", "adaptive", ["static", "adaptive"],
                  "Broker routing: static l > t, or the adaptive PrfaasRouter (section 3.4.3) "
                  "on a live ClusterView with both regions' prefix caches.")
flags.DEFINE_integer("prefix_block", 64, "Hybrid prefix cache block (tokens) in both regions; "
                     "0: no prefix cache.")
flags.DEFINE_integer("shared_prefix_tokens", 0, "Shared-prefix workload: every prompt starts "
                     "with the same N tokens (a system prompt), then its own tokens.")

flags.DEFINE_enum("launcher", "local", ["local", "ray"],
                  "local: child processes of this one; ray: Ray actors (serving/ray_launch.py), "
                  "region A on a node with the custom resource region_a, region B (PD nodes, "
                  "relay, broker) on a region_b node.")
flags.DEFINE_string("ray_address", None, "With --launcher=ray: join this Ray cluster ('auto' or "
                    "host:port); unset: start a local one-node Ray with both region resources.")
flags.DEFINE_integer("decode_regions", 1, "Decode regions served by the one region-A prefill "
                     "pool (B, C, ...): each its own PD nodes, link, relay and broker; request i "
                     "goes to region i mod N. Prefill as a shared service.")
flags.DEFINE_list("region_links", ["25mbit/40"], "Links of regions C, D, ... as rate/rtt_ms "
                  "(region B's: --bandwidth/--rtt_ms/--trace); the last one repeats.")
flags.DEFINE_enum("tenant_sharing", "wfq", ["wfq", "fifo"], "How the decode regions share "
                  "region A: weighted fair queueing over prompt tokens, or arrival order.")
flags.DEFINE_string("tenant_weights", "", "Region weights for wfq, e.g. 'B=2,C=1'.")
flags.DEFINE_integer("prefill_pod", 1, "Region A as a pod of this many processes (TP over all; "
                     "serving/pod_prefill_server.py). --fault=kill_pod_process: pod process 1 "
                     "dies mid-prefill of the pod's 2nd request; the pod restarts as a unit.")
flags.DEFINE_integer("decode_slice", 1, "Region B's PD node 0 (the first --slice_nodes nodes) "
                     "as a decode slice of this many processes (TP over all; serving/"
                     "slice_decode_server.py); with --pd_nodes > --slice_nodes the others are "
                     "single decode servers. Needs a "
                     "prefill pod: left at its default, --prefill_pod becomes 2 (printed); "
                     "--prefix_block gives the slice a prefix cache for its own local "
                     "prefills; conflicting flags are refused.")
flags.DEFINE_integer("decode_slice_devices", 1, "Devices per decode slice process.")
flags.DEFINE_integer("slice_nodes", 1, "How many of region B's PD nodes, from node 0 on, are "
                     "decode slices of --decode_slice processes each (the rest single decode "
                     "servers); needs --decode_slice > 1 and --pd_nodes >= this.")
flags.DEFINE_bool("tls", True, "Mutual TLS between broker and regions and TLS + a bearer "
                  "token at the broker (a local CA and token in <workdir>/certs); --notls "
                  "runs every process with an explicit --insecure.")
flags.DEFINE_enum("fault", "none", ["none", "kill_prefill", "preempt_prefill", "kill_decode",
                                    "drop_link", "stall_link", "corrupt_chunks", "corrupt_state",
                                    "kill_pod_process"],
                  "Inject a fault: kill_prefill: region A exits right after the first partial "
                  "commit point of a streamed prompt (the broker resumes the request from it "
                  "on region B; restarted after --fault_duration_s); preempt_prefill: SIGTERM "
                  "region A once, from --fault_at_s on, a prompt is mid-stream (the broker saw a "
                  "partial commit point), with a 0.5 s grace period (it stops taking work, "
                  "commits what it can and hands in-flight requests to resume; restarted "
                  "after --fault_duration_s); kill_decode: SIGKILL region B at --fault_at_s (its "
                  "requests fail with UNAVAILABLE; restarted after --fault_duration_s); "
                  "drop_link / stall_link: the WAN link resets / stalls for "
                  "--fault_duration_s; corrupt_chunks: 3 state chunks are corrupted on the wire; "
                  "corrupt_state: region B damages --fault_states received states after "
                  "the transport verified them (the logit probe must catch each one, and "
                  "the broker re-prefills those requests locally).")
flags.DEFINE_integer("fault_states", 3, "States damaged by --fault=corrupt_state.")
flags.DEFINE_bool("logit_probe", True, "The fail-closed logit probe at the handoff "
                  "(--nologit_probe with --fault=corrupt_state shows what it prevents).")
flags.DEFINE_float("fault_at_s", 1.0, "When kill_decode / drop_link / stall_link strike "
                   "(seconds after the first request).")
flags.DEFINE_float("fault_duration_s", 3.0, "Outage length, or how long a killed server "
                   "stays down.")

def main(argv):
  del argv
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  os.chdir(REPO)
  from paas_jax.models import load_config  # pylint: disable=g-import-not-at-top
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    tqdm = None
  progress = FLAGS.progress and tqdm is not None
  t_start = time.perf_counter()
  # Before anything loads: a slice's constraints against the other flags.
  pools = resolve_pools(
      decode_slice=FLAGS.decode_slice, decode_slice_devices=FLAGS.decode_slice_devices,
      prefill_pod=FLAGS.prefill_pod, prefix_block=FLAGS.prefix_block, pd_nodes=FLAGS.pd_nodes,
      slice_nodes=FLAGS.slice_nodes, decode_regions=FLAGS.decode_regions, fault=FLAGS.fault, tls=FLAGS.tls,
      explicit={name for name in ("prefill_pod", "prefix_block", "tls")
                if FLAGS[name].present})
  for note in pools.notes:
    print(f"note       : {note}")
  if FLAGS.checkpoint:
    from paas_jax.serving import common  # pylint: disable=g-import-not-at-top
    config = common.load_model("", checkpoint=FLAGS.checkpoint)[0].config
  else:
    config = load_config(FLAGS.config)
  context = min(FLAGS.context, config.max_seq_len)
  max_new = FLAGS.max_new_tokens
  if not 0 < max_new < context:
    raise app.UsageError(f"--max_new_tokens must be in (0, {context})")
  reqs, dist, scale = make_workload(
      config, FLAGS.num_requests, max_new, context, FLAGS.seed, rate=FLAGS.rate,
      length_mu=FLAGS.length_mu, length_sigma=FLAGS.length_sigma,
      shared_prefix_tokens=FLAGS.shared_prefix_tokens)
  if not 1 <= FLAGS.decode_regions <= 8:
    raise app.UsageError("--decode_regions must be in [1, 8]")
  for r in reqs:  # request i -> region i mod N (B, C, ...)
    r.region = chr(ord("b") + r.index % FLAGS.decode_regions)
  threshold = FLAGS.threshold if FLAGS.threshold >= 0 else round(PAPER_T * scale)
  trace = BandwidthTrace.parse(FLAGS.trace) if FLAGS.trace else None
  link = LinkSpec(bandwidth_bps=parse_rate(FLAGS.bandwidth), rtt_s=FLAGS.rtt_ms / 1e3,
                  jitter_s=FLAGS.jitter_ms / 1e3, trace=trace, seed=FLAGS.seed)
  netem = FLAGS.netem
  if netem != "relay":
    ok, why = netns_available()
    if not ok:
      if netem == "netns":
        raise app.UsageError(f"--netem=netns is not possible here: {why}")
      print(f"netns shaping unavailable ({why}); using the userspace relay")
      netem = "relay"
    elif netem == "auto":
      netem = "netns"
  buckets = tuple(int(b) for b in FLAGS.prefill_buckets)
  region_links = [link]
  for i in range(1, FLAGS.decode_regions):
    rate, _, rtt = FLAGS.region_links[min(i, len(FLAGS.region_links)) - 1].partition("/")
    region_links.append(LinkSpec(bandwidth_bps=parse_rate(rate),
                                 rtt_s=float(rtt or FLAGS.rtt_ms) / 1e3,
                                 jitter_s=FLAGS.jitter_ms / 1e3, seed=FLAGS.seed + i))
  spec = ClusterSpec(config=FLAGS.config, seed=FLAGS.seed, n_slots=FLAGS.n_slots,
                     decode_regions=FLAGS.decode_regions, region_links=tuple(region_links),
                     tenant_sharing=FLAGS.tenant_sharing, tenant_weights=FLAGS.tenant_weights,
                     max_ctx=context, max_queue=FLAGS.max_queue, prefill_buckets=buckets,
                     threshold=threshold, link=link, netem=netem, relay_engine=FLAGS.relay_engine,
                     codec_compression=FLAGS.codec, router=FLAGS.router,
                     transfer_plane=FLAGS.transfer_plane,
                     prefix_block=pools.prefix_block, rebalance_every_s=2.0,
                     compilation_cache=FLAGS.compilation_cache, tls=pools.tls,
                     prefill_faults={"kill_prefill": "kill_after_commits=1,kill_on_transfer=0",
                                     "preempt_prefill": "layer_delay_s=0.25",
                                     "corrupt_chunks": "corrupt_chunks=3"}.get(FLAGS.fault, ""),
                     decode_faults=(f"corrupt_states={FLAGS.fault_states}"
                                    if FLAGS.fault == "corrupt_state" else ""),
                     logit_probe=FLAGS.logit_probe,
                     # A commit point per chunk, so that faults find partial ones.
                     prefill_args=("--commit_every=1", "--preempt_grace_s=0.5")
                     if FLAGS.fault in ("kill_prefill", "preempt_prefill") else (),
                     flaky_wan=FLAGS.fault in ("drop_link", "stall_link"),
                     pd_nodes=FLAGS.pd_nodes, rebalance_apply=FLAGS.rebalance_apply,
                     checkpoint=FLAGS.checkpoint, dtype=FLAGS.dtype,
                     http=FLAGS.http_port >= 0, http_port=max(FLAGS.http_port, 0),
                     prefill_pod=pools.prefill_pod, prefill_pod_fault=(
                         "1:prefill:2" if FLAGS.fault == "kill_pod_process" else ""),
                     decode_slice=FLAGS.decode_slice,
                     decode_slice_devices=FLAGS.decode_slice_devices,
                     slice_nodes=FLAGS.slice_nodes)
  lengths = [len(r.prompt) for r in reqs]
  print(f"model      : {config.name} ("
        + (f"checkpoint {FLAGS.checkpoint}" if FLAGS.checkpoint else f"random init, seed "
           f"{FLAGS.seed}") + f", {FLAGS.dtype or config.dtype}), context {context}")
  print(f"workload   : {len(reqs)} requests, Poisson {FLAGS.rate:g}/s, {max_new} new tokens; "
        f"prompt lengths ~ truncated log-normal(mu={dist.mu:.2f}, sigma={dist.sigma:g}) on "
        f"[{dist.lo:.0f}, {dist.hi:.0f}] (paper x{scale:.5f}); sampled: median "
        f"{int(np.median(lengths))}, max {max(lengths)}")
  print(f"routing    : {FLAGS.router} router, t={threshold:g} tokens (l > t -> PrfaaS region "
        f"A); {sum(l > threshold for l in lengths)} of {len(reqs)} longer than t; prefix "
        f"cache block {pools.prefix_block or 'off'}, shared prefix "
        f"{FLAGS.shared_prefix_tokens} tokens")
  print(f"link A<->B : {describe(link)} via {netem}")
  for i, region_link in enumerate(region_links[1:], 1):
    print(f"link A<->{chr(ord('B') + i)} : {describe(region_link)} via relay (its own "
          f"broker and PD nodes; region A shared by {FLAGS.tenant_sharing})")
  print("security   : " + ("mutual TLS broker<->regions and A->B, TLS + bearer token at the "
                            "broker" if pools.tls else "PLAINTEXT (--notls)"))
  if FLAGS.fault != "none":
    print(f"fault      : {FLAGS.fault} (at {FLAGS.fault_at_s:g} s, for "
          f"{FLAGS.fault_duration_s:g} s)")
  pod_note = f" pod of {pools.prefill_pod} processes" if pools.prefill_pod > 1 else ""
  slice_note = (f" {FLAGS.slice_nodes} slice(s) of {FLAGS.decode_slice} processes x "
                f"{FLAGS.decode_slice_devices} devices" if FLAGS.decode_slice > 1 else "")
  print(f"starting   : region A (prefill{pod_note}), region B (decode{slice_note} + PD-P), WAN "
        "relay, broker (first run compiles the engines; later runs load them from the "
        "cache) ...")
  if FLAGS.launcher == "ray":
    if netem == "netns" or FLAGS.fault in ("drop_link", "stall_link"):
      raise app.UsageError("--launcher=ray runs the userspace relay and no in-process "
                           "link faults (--netem=relay, no drop_link/stall_link)")
    cluster = RayCluster(spec, FLAGS.workdir, RayPlacement(address=FLAGS.ray_address))
    print(f"placement  : Ray ({FLAGS.ray_address or 'local ray.init()'}), region A on a "
          "region_a node, region B on a region_b node")
  else:
    cluster = LocalCluster(spec, FLAGS.workdir)
  bar = tqdm(desc="warm-up", bar_format="{desc}: {elapsed}", leave=False) if progress else None
  try:
    cluster.start(on_tick=(lambda: bar.refresh()) if bar is not None else None)
  finally:
    if bar is not None:
      bar.close()
  startup = {name: p.info.get("startup_s") for name, p in cluster.procs.items()}
  print(f"ready      : broker {cluster.broker_address} after "
        f"{cluster.timings['cluster_ready_s']:.1f} s (process start-up incl. compile: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items() if v) + ")")
  if FLAGS.http_port >= 0:
    print(f"OpenAI API : {cluster.http_url} (bearer token: {cluster.certs}/client.token)"
          if cluster.certs else f"OpenAI API : {cluster.http_url}")
  try:
    bar = tqdm(total=len(reqs), desc="requests", unit="req") if progress else None
    fault_log: list[str] = []
    faulter = threading.Thread(target=inject_fault, args=(cluster, fault_log, FLAGS.fault,
                                                          FLAGS.fault_at_s, FLAGS.fault_duration_s), daemon=True)
    faulter.start()
    wall = run_workload(cluster.broker_addresses, reqs, max_new, bar,
                        credentials=cluster.client_credentials())
    if bar is not None:
      bar.close()
    faulter.join(FLAGS.fault_at_s + FLAGS.fault_duration_s + 120)
    from paas_jax.client import BrokerClient  # pylint: disable=g-import-not-at-top
    if FLAGS.router == "adaptive":
      time.sleep(2.5)  # one more rebalancer step (every 2 s) sees the whole workload
    with BrokerClient(cluster.broker_address, credentials=cluster.client_credentials()) as c:
      broker_stats = c.stats()
    recent_all = []  # every region's broker's records of its requests
    for address in cluster.broker_addresses.values():
      with BrokerClient(address, credentials=cluster.client_credentials()) as c:
        recent_all += c.stats().get("recent", [])
    decode_stats = server_stats(cluster, "decode", "DecodeStub")
    prefill_stats = server_stats(cluster, "prefill", "PrefillStub")
  finally:
    cluster.stop()
  relay = cluster.relay_stats()
  relays = {region: cluster.relay_stats(region) for region in cluster.decode_regions}

  if FLAGS.reference:
    bar = tqdm(total=len(reqs), desc="reference", unit="req") if progress else None
    compute_reference(reqs, max_new, bar, config=FLAGS.config, seed=FLAGS.seed,
                      checkpoint=FLAGS.checkpoint, dtype=FLAGS.dtype or None,
                      compilation_cache=FLAGS.compilation_cache)
    if bar is not None:
      bar.close()

  recent = {d.get("request_id"): d for d in recent_all}
  rows = []
  for r in reqs:
    s = r.summary
    rec = recent.get(f"demo-{r.index:03d}", {})
    rows.append({
        "request": r.index, "region": r.region, "prompt_tokens": len(r.prompt),
        "route": s.get("route", ""),
        "input_tokens": len(r.prompt), "output_tokens": max(len(r.tokens), 1),
        "arrival_s": r.arrival_s,
        "route_reason": rec.get("route_reason", s.get("route_reason", "")),
        "threshold_tokens": rec.get("threshold", s.get("threshold_tokens")),
        "bandwidth_mode": rec.get("bandwidth_mode", ""),
        "prefix_source": rec.get("prefix_source", ""),
        "l_pd_cached": rec.get("l_pd_cached", 0), "l_prfaas_cached": rec.get("l_prfaas_cached", 0),
        "cached_tokens": int(rec.get("cached_tokens", s.get("cached_tokens", 0))),
        "prefix_transfer": rec.get("prefix_transfer", ""),
        "prefix_transfer_tokens": int(rec.get("prefix_transfer_tokens", 0)),
        "prefix_transfer_bytes": int(rec.get("prefix_transfer_bytes", 0)),
        "prefix_transfer_s": float(rec.get("prefix_transfer_s", 0.0)),
        "prefix_transfer_error": rec.get("prefix_transfer_error", ""),
        "commit_point": int(rec.get("commit_point", 0)),
        "resumed_tokens": int(rec.get("resumed_tokens", 0)),
        "recomputed_tokens": int(rec.get("recomputed_tokens", 0)),
        "temperature": r.temperature, "seed": r.seed, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
        "total_s": r.total_s, "link_bytes": int(s.get("link_bytes", 0)),
        "state_bytes": int(s.get("state_bytes", 0)),
        "transfer_s": float(s.get("transfer_s", 0.0)),
        # State bytes per second of the transfer (Begin to committed).
        "goodput_mb_s": (int(s.get("state_bytes", 0)) / float(s["transfer_s"]) / 1e6
                         if float(s.get("transfer_s", 0.0)) > 0 else None),
        "prefill_s": float(s.get("prefill_s", 0.0)),
        "prefill_queue_s": float(s.get("prefill_queue_s", 0.0)),
        "decode_queue_s": float(s.get("decode_queue_s", 0.0)),
        "tokens": r.tokens, "error": r.error,
        "matches_reference": None if r.reference is None else r.tokens == r.reference})
  ok = [r for r in rows if not r["error"]]
  by_route = {}
  for route in ("pdp", "prfaas"):
    sel = [r for r in ok if r["route"] == route]
    by_route[route] = {"requests": len(sel),
                       "ttft_s": summarize([r["ttft_s"] for r in sel]),
                       "tpot_s": summarize([r["tpot_s"] for r in sel]),
                       "link_bytes": int(sum(r["link_bytes"] for r in sel)),
                       "goodput_mb_s": summarize([r["goodput_mb_s"] for r in sel
                                               if r["goodput_mb_s"] is not None])}
  matches = [r["matches_reference"] for r in rows]
  all_match = bool(FLAGS.reference and all(m is True for m in matches) and
                   len(ok) == len(rows))
  reasons = {}
  for r in ok:
    key = f"{r['route']}:{r['route_reason']}"
    reasons[key] = reasons.get(key, 0) + 1
  router_info = broker_stats.get("router") or {}
  routing = {
      "router": FLAGS.router, "base_threshold_tokens": threshold,
      "threshold_in_force": router_info.get("threshold_tokens"),
      "effective_thresholds": sorted({r["threshold_tokens"] for r in ok
                                      if r["threshold_tokens"] is not None}),
      "decisions": reasons,
      "cross_cluster_prefix_decisions": sum(
          1 for r in ok if r["prefix_source"] not in ("", "none", r["route"])),
      # Of those, shipped (ExportPrefix) and failed (prefilled without the prefix).
      "prefix_transfers": sum(1 for r in ok if r["prefix_transfer_tokens"] > 0),
      "prefix_transfer_failed": sum(1 for r in ok if r["prefix_transfer_error"]),
      "live_view": router_info.get("live_view"), "rebalance": router_info.get("rebalance"),
      "router_config": router_info.get("router_config"),
      "pd_roles": router_info.get("roles"), "role_moves": router_info.get("role_moves"),
  }
  prefix_cache = {
      "block_tokens": pools.prefix_block, "shared_prefix_tokens": FLAGS.shared_prefix_tokens,
      "hit_tokens": int(sum(r["cached_tokens"] for r in ok)),
      "hit_tokens_by_route": {rt: int(sum(r["cached_tokens"] for r in ok if r["route"] == rt))
                              for rt in ("pdp", "prfaas")},
      "requests_with_hits": sum(1 for r in ok if r["cached_tokens"] > 0),
      # Cross-cluster prefix transfers, by direction ("prfaas->pdp", "pdp->prfaas").
      "transferred": {d: {"requests": len(sel),
                          "tokens": int(sum(r["prefix_transfer_tokens"] for r in sel)),
                          "link_bytes": int(sum(r["prefix_transfer_bytes"] for r in sel)),
                          "seconds": summarize([r["prefix_transfer_s"] for r in sel])}
                      for d in ("prfaas->pdp", "pdp->prfaas")
                      for sel in [[r for r in ok if r["prefix_transfer"] == d
                                   and r["prefix_transfer_tokens"] > 0]]},
      "prompt_tokens": int(sum(r["prompt_tokens"] for r in ok)),
      "decode_server": {k: v for k, v in decode_stats.items() if k.startswith("prefix")},
      "prefill_server": {k: v for k, v in prefill_stats.items() if k.startswith("prefix")},
  }
  report = {
      "model": config.name, "seed": FLAGS.seed, "context": context,
      "routing": routing, "prefix_cache": prefix_cache,
      "link_bandwidth_bps": link.bandwidth_bps,
      # A slice's own figure if its stats give one (none: one request at a time).
      "decode_max_batch_size": (decode_stats.get("slots_total") if FLAGS.decode_slice > 1
                                else FLAGS.n_slots),
      "prefill_pod": pools.prefill_pod, "decode_slice": FLAGS.decode_slice,
      "decode_slice_devices": FLAGS.decode_slice_devices,
      "num_requests": len(reqs), "max_new_tokens": max_new, "threshold_tokens": threshold,
      "length_distribution": {"mu": dist.mu, "sigma": dist.sigma, "lo": dist.lo,
                              "hi": dist.hi, "paper_scale": scale},
      "netem": netem, "relay_engine": spec.relay_engine, "link": link.to_dict(),
      "errors": len(rows) - len(ok),
      "workload_wall_s": wall,
      "throughput_tokens_per_s": sum(len(r["tokens"]) for r in ok) / wall if wall else None,
      "ttft_s": summarize([r["ttft_s"] for r in ok]), "tpot_s": summarize([r["tpot_s"] for r in ok]),
      "routes": by_route,
      # Prefill as a shared service: per decode region (tenant) TTFT, link bytes,
      # region A's egress accounting for it, and its relay's bytes.
      "decode_regions": FLAGS.decode_regions, "tenant_sharing": FLAGS.tenant_sharing,
      "regions": tenant_report.per_region(rows, prefill_stats, relays),
      "link_utilization": link_report(relay, link),
      "startup_s": cluster.timings, "process_startup_s": startup,
      # Which machine ran each process (Ray: its node; local: this host).
      "launcher": FLAGS.launcher,
      "placement": {name: {k: p.info.get(k) for k in ("node_ip", "node_id", "restarts")
                           if k in p.info} for name, p in cluster.procs.items()},
      "broker": {k: v for k, v in broker_stats.items() if k not in ("recent", "inflight")},
      "decode_server": decode_stats, "prefill_server": prefill_stats,
      "all_tokens_match_reference": all_match if FLAGS.reference else None,
      "requests": rows,
      "total_wall_s": time.perf_counter() - t_start,
      "security": {"tls": pools.tls, "bearer_token": pools.tls},
      "fault": {"kind": FLAGS.fault, "at_s": FLAGS.fault_at_s,
                "duration_s": FLAGS.fault_duration_s, "events": fault_log,
                "reroutes": broker_stats.get("reroutes", 0),
                "fallback_pdp": broker_stats.get("fallback_pdp", 0),
                "completed": len(ok),
                "completed_match_reference": bool(FLAGS.reference and all(
                    r["matches_reference"] is True for r in ok)),
                "error_codes": sorted({r["error"].split(":", 1)[0] for r in rows
                                       if r["error"]}),
                # The logit probe at the handoff (paas_jax.serving.handoff_probe):
                # damaged states it caught, and answers that reached a client wrong.
                "probe_mismatches": int(decode_stats.get("handoff_probe_mismatch", 0)),
                "probe_checked": int(decode_stats.get("handoff_probe_ok", 0)
                                     + decode_stats.get("handoff_probe_mismatch", 0)),
                "wrong_answers_delivered": (sum(1 for r in ok if r["matches_reference"] is False)
                                            if FLAGS.reference else None),
                # Resume, do not recompute (serving/resume.py): requests resumed
                # from a commit point and the prompt tokens that saved.
                "resumed_requests": sum(1 for r in rows if r["resumed_tokens"] > 0),
                "tokens_saved": sum(r["resumed_tokens"] for r in rows),
                "tokens_recomputed_by_retries": sum(r["recomputed_tokens"] for r in rows)},
  }
  out = pathlib.Path(FLAGS.json_out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1))

  print_summary(report, out)
  if FLAGS.fault == "corrupt_state":
    # Every damaged state caught, no wrong answer, no failed request.
    f = report["fault"]
    caught = f["probe_mismatches"] >= 1 or not FLAGS.logit_probe
    return 0 if (caught and all_match and not report["errors"]) else 1
  if FLAGS.fault == "kill_decode":
    # Requests on the killed server fail with a clear status; the rest must be exact.
    ok_codes = set(report["fault"]["error_codes"]) <= {"UNAVAILABLE"}
    return 0 if ok_codes and (report["fault"]["completed_match_reference"]
                              or not FLAGS.reference) else 1
  return 0 if (all_match or not FLAGS.reference) and not report["errors"] else 1


if __name__ == "__main__":
  app.run(main)
