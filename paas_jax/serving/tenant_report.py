"""Per-decode-region summary of a run on a shared prefill pool (pure).

When one region-A pool serves several decode regions (``ClusterSpec.
decode_regions``), the demo and ``experiments/bench_shared_prefill.py`` report,
per region: its requests' TTFT, the state bytes its broker saw cross its link,
region A's egress accounting for that tenant (prefill ``GetStats``
``egress_bytes:<T>``), the prompt tokens region A prefilled for it, and the
bytes its relay carried A -> region.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def latency_stats(xs: Sequence[float]) -> dict | None:
  """n, mean, p50, p90, max of ``xs`` (seconds); None when empty."""
  xs = [float(x) for x in xs if x is not None]
  if not xs:
    return None
  a = np.asarray(xs)
  return {"n": len(xs), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
          "p90": float(np.percentile(a, 90)), "max": float(a.max())}


def per_region(rows: Sequence[Mapping], prefill_gauges: Mapping[str, float],
               relay_stats: Mapping[str, Mapping | None]) -> dict:
  """``rows``: one dict per request with ``region`` ("b", "c", ...), ``ttft_s``,
  ``link_bytes``, ``route`` and ``error``; returns {region: summary}."""
  out = {}
  for region in sorted({r["region"] for r in rows}):
    mine = [r for r in rows if r["region"] == region]
    ok = [r for r in mine if not r.get("error")]
    tenant = region.upper()
    relay = relay_stats.get(region) or {}
    out[region] = {
        "tenant": tenant, "requests": len(mine), "errors": len(mine) - len(ok),
        "prfaas_requests": sum(1 for r in ok if r.get("route") == "prfaas"),
        "ttft_s": latency_stats([r["ttft_s"] for r in ok]),
        "link_bytes": int(sum(int(r.get("link_bytes", 0)) for r in ok)),
        "egress_bytes": int(prefill_gauges.get(f"egress_bytes:{tenant}", 0)),
        "egress_transfers": int(prefill_gauges.get(f"egress_transfers:{tenant}", 0)),
        "prefill_tokens": int(prefill_gauges.get(f"tenant_prefill_tokens:{tenant}", 0)),
        "rejected_quota": int(prefill_gauges.get(f"rejected_quota:{tenant}", 0)),
        "relay_a_to_b_bytes": int((relay.get("a_to_b") or {}).get("bytes", 0)),
    }
  return out
