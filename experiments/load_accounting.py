"""Accounting of ``load_test``: every request lands in exactly one outcome.

Flag-free so tests import it without loading the launcher's absl flags (two
launchers in one process would define ``--seed`` twice).
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Outcome:
  kind: str = "lost"          # completed | rejected | failed | lost
  code: str = ""
  ttft_s: float | None = None
  total_s: float | None = None
  tokens_ok: bool | None = None
  route: str = ""
  done: bool = False



def percentile(values: list[float], q: float) -> float | None:
  if not values:
    return None
  v = sorted(values)
  k = min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))
  return v[k]


def summarize(outcomes: list[Outcome], window_s: float) -> dict:
  kinds = collections.Counter(o.kind for o in outcomes)
  rejected = collections.Counter(o.code for o in outcomes if o.kind == "rejected")
  failed = collections.Counter(o.code for o in outcomes if o.kind == "failed")
  lost = collections.Counter(o.code or "open_at_drain_deadline" for o in outcomes
                             if o.kind == "lost")
  done = [o for o in outcomes if o.kind == "completed"]
  ttft = [o.ttft_s for o in done if o.ttft_s is not None]
  e2e = [o.total_s for o in done if o.total_s is not None]
  ms = lambda x: None if x is None else round(x * 1e3, 2)
  return {
      "sent": len(outcomes),
      "accepted": len(outcomes) - kinds["rejected"],
      "completed": kinds["completed"],
      "rejected": kinds["rejected"],
      "rejected_by_code": dict(rejected),
      "failed": kinds["failed"],
      "failed_by_code": dict(failed),
      "lost": kinds["lost"],
      "lost_by_reason": dict(lost),
      "wrong_tokens": sum(1 for o in done if o.tokens_ok is False),
      "routes": dict(collections.Counter(o.route for o in done)),
      "completed_per_s": round(len(done) / window_s, 3) if window_s > 0 else None,
      "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99))},
      "latency_ms": {"p50": ms(percentile(e2e, 50)), "p99": ms(percentile(e2e, 99))},
  }
