"""The two-region demo's printed summary: one line per request, then per route,
the link, the decode pool or slice, routing, prefix cache, faults and regions.

Everything comes from the report the demo writes (``demo_two_region.main``), so
the printout and the JSON cannot disagree.
"""

from __future__ import annotations

import json
import pathlib


def print_summary(report: dict, out: pathlib.Path) -> None:
  """Prints a finished demo's report (``report``, written to ``out``) for people."""
  routing, prefix_cache = report["routing"], report["prefix_cache"]
  by_route, decode_stats, netem = report["routes"], report["decode_server"], report["netem"]
  wall, prefill_pod = report["workload_wall_s"], report["prefill_pod"]
  decode_regions = report["decode_regions"]
  decode_slice, slice_devices = report["decode_slice"], report["decode_slice_devices"]
  print()
  print(f"{'req':>3} {'prompt':>6} {'route':>6} {'TTFT ms':>8} {'TPOT ms':>8} "
        f"{'link KiB':>8} {'xfer ms':>7} {'MB/s':>7} {'match':>5}")
  for r in report["requests"]:
    m = {True: "yes", False: "NO", None: "-"}[r["matches_reference"]]
    if r["error"]:
      print(f"{r['request']:>3} {r['prompt_tokens']:>6} error: {r['error']}")
      continue
    print(f"{r['request']:>3} {r['prompt_tokens']:>6} {r['route']:>6} "
          f"{r['ttft_s'] * 1e3:8.1f} {r['tpot_s'] * 1e3:8.2f} {r['link_bytes'] / 1024:8.1f} "
          f"{r['transfer_s'] * 1e3:7.1f} "
          f"{'-' if r['goodput_mb_s'] is None else format(r['goodput_mb_s'], '.1f'):>7} {m:>5}")
  print()
  for route, name in (("pdp", "PD-P (local)"), ("prfaas", "PrfaaS (remote)")):
    b = by_route[route]
    if b["requests"]:
      print(f"{name:16}: {b['requests']:3d} requests, TTFT mean {b['ttft_s']['mean'] * 1e3:.0f} "
            f"ms p90 {b['ttft_s']['p90'] * 1e3:.0f} ms, TPOT mean "
            f"{b['tpot_s']['mean'] * 1e3:.2f} ms, link {b['link_bytes'] / 1024:.1f} KiB"
            + (f", goodput per transfer mean {b['goodput_mb_s']['mean']:.1f} MB/s"
               if route == "prfaas" and b["goodput_mb_s"] else ""))
  lu = report["link_utilization"].get("a_to_b", {})
  if lu:
    util = lu.get("utilization")
    print(f"link A->B        : {lu.get('bytes', 0) / 1024:.1f} KiB on the wire, "
          f"utilization over its active span {'n/a' if util is None else f'{100 * util:.1f}%'}"
          + (f", busy {lu['busy_s']:.2f} s" if netem == "relay" and lu.get("busy_s") else ""))
  print(f"throughput       : {report['throughput_tokens_per_s']:.1f} tokens/s over "
        f"{wall:.1f} s; errors: {report['errors']}")
  if "mean_step_ms" in decode_stats:
    print(f"decode pool      : {decode_stats['steps']:.0f} steps, mean "
          f"{decode_stats['mean_step_ms']:.2f} ms/step, mean batch "
          f"{decode_stats['mean_batch']:.2f} of {decode_stats['slots_total']:.0f} slots")
  if decode_slice > 1:
    print(f"decode slice     : {decode_slice} processes x {slice_devices} "
          f"devices (TP={decode_stats.get('slice_tp', 0):.0f}), "
          f"{decode_stats.get('jobs_done', 0):.0f} requests decoded, "
          f"{decode_stats.get('jobs_failed', 0):.0f} failed; region A a pod of "
          f"{prefill_pod} processes")
  print(f"routing          : {routing['router']}, t in force {routing['threshold_in_force']}, "
        f"decisions {json.dumps(routing['decisions'])}")
  if routing["rebalance"]:
    print(f"rebalancer       : {json.dumps(routing['rebalance'])}")
  print(f"prefix cache     : {prefix_cache['hit_tokens']} hit tokens of "
        f"{prefix_cache['prompt_tokens']} prompt tokens ({prefix_cache['requests_with_hits']} "
        f"requests hit; by route {json.dumps(prefix_cache['hit_tokens_by_route'])})")
  for d, t in prefix_cache["transferred"].items():
    if t["requests"]:
      print(f"prefix transfer  : {d}: {t['requests']} requests, {t['tokens']} tokens, "
            f"{t['link_bytes']} bytes on the link")
  if report["fault"]["kind"] != "none":
    f = report["fault"]
    for event in f["events"]:
      print(f"fault            : {event}")
    print(f"resume           : {f['resumed_requests']} requests resumed from a commit point, "
          f"{f['tokens_saved']} prompt tokens not recomputed, "
          f"{f['tokens_recomputed_by_retries']} recomputed by retries")
    print(f"fault outcome    : {f['reroutes']:.0f} reroutes ({f['fallback_pdp']:.0f} to PD-P), "
          f"{report['errors']} requests failed {f['error_codes']}, completed requests "
          f"match the reference: {json.dumps(f['completed_match_reference'])}")
    print(f"logit probe      : {f['probe_checked']} handed-off states checked, "
          f"{f['probe_mismatches']} mismatches caught (DATA_LOSS, re-prefilled locally); "
          f"wrong answers delivered: {f['wrong_answers_delivered']}")
  if decode_regions > 1:
    for region, g in report["regions"].items():
      ttft = g["ttft_s"] or {}
      print(f"region {g['tenant']}         : {g['requests']} requests "
            f"({g['prfaas_requests']} via region A), TTFT p90 "
            f"{ttft.get('p90', 0) * 1e3:.0f} ms; region A egress to it "
            f"{g['egress_bytes'] / 1024:.1f} KiB in {g['egress_transfers']} transfers, "
            f"its link carried {g['relay_a_to_b_bytes'] / 1024:.1f} KiB")
  print(f"all_tokens_match_reference: {json.dumps(report['all_tokens_match_reference'])}")
  print(f"report           : {out}  (total {report['total_wall_s']:.1f} s)")
