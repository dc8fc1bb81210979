"""Resume, do not recompute: what happens to a request whose prefill stream broke.

A remote (PrfaaS, or PD-P -> PD-D) prefill streams the prompt chunk by chunk
(``chunk_stream``); the decode node keeps every verified segment and the
commit points they make (``commit_points.SegmentAssembler``). When region A
dies or the link drops after commit point ``n``, the decode node still holds
the prompt's first ``n`` tokens (full-attention KV plus the fixed-size state at
``n``). Two halves:

* decode side (``commit_points.resume_point``): a new attempt registered with
  ``DecodeRequest.resume_from = <earlier attempt's id>`` prefills locally (PD-P)
  from the newest commit point strictly before the prompt's end (the first
  token needs the last position's logits), so only ``L - n`` tokens are
  computed again; without a commit point it is a full prefill.
* broker side (``ResumePolicy.decide``): after a prefill-side failure of an
  attempt whose state streamed to decode node ``di``, pick between resuming on
  ``di`` and re-prefilling elsewhere, by the router's own model: the committed
  prefix counts as a prefix cached in the PD region (``RouteRequest
  .cached_prefix_tokens = n``); when the router would then keep the request
  local (``l = L - n`` under its threshold), or no other prefill server is
  healthy, it resumes; otherwise it re-prefills on another PrfaaS node. This is
  an offer: ``request_lifecycle.retry_decision`` takes it as one of its facts
  and alone decides (a damaged state, ``FailureCause.STATE_DAMAGED``, is never
  resumed: its commit points are not trusted).

Per request the broker records the prompt tokens not recomputed
(``RequestRecord.resumed_tokens``) and exports them as the Prometheus metrics
``paas_resumed_requests_total``, ``paas_resume_saved_tokens_total`` and
``paas_resume_recomputed_tokens_total`` (``ResumeMetrics``).

JAX-free (the broker imports it; ``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses

import prometheus_client as prom

from paas_jax.serving.routing import PDP, PRFAAS, RouteRequest


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
  """``resume``: register the next attempt on decode node ``decode_index`` with
  ``resume_from = earlier_id`` (local prefill from its commit point); else
  re-prefill on route ``route`` as the broker would without resume."""

  resume: bool
  route: str
  decode_index: int
  earlier_id: str
  commit_point: int
  reason: str


class ResumePolicy:
  """Broker-side choice between resuming and re-prefilling (module docstring)."""

  def __init__(self, policy=None, enabled: bool = True):
    self.policy = policy  # the broker's RoutingPolicy (its model), or None
    self.enabled = enabled

  def decide(self, *, prompt_tokens: int, commit_point: int, earlier_id: str,
             decode_index: int, decode_healthy: bool, other_prefill: bool,
             streamed: bool) -> ResumeDecision | None:
    """None: not a resumable failure (the broker's ordinary retry applies).

    Args:
      prompt_tokens: L.
      commit_point: n as region A last reported it (the decode node may hold
        more: it resumes from what it holds).
      earlier_id: the failed attempt's downstream id (its segments' id).
      decode_index: the decode node the attempt streamed to.
      decode_healthy: whether that node is still up (its segments with it).
      other_prefill: another healthy PrfaaS prefill server exists.
      streamed: the attempt streamed chunks (a remote or PD-split prefill).
    """
    if not (self.enabled and streamed and decode_healthy and decode_index >= 0):
      return None
    n = max(0, min(commit_point, prompt_tokens - 1))
    if not other_prefill:
      return ResumeDecision(True, PDP, decode_index, earlier_id, n,
                            f"resume:n={n}:no_other_prefill")
    if self.policy is not None:
      d = self.policy.decide(RouteRequest(prompt_tokens=prompt_tokens,
                                          cached_prefix_tokens=n))
      if d.route == PRFAAS:
        return ResumeDecision(False, PRFAAS, decode_index, earlier_id, n,
                              f"reprefill:n={n}:{d.reason}")
      return ResumeDecision(True, PDP, decode_index, earlier_id, n, f"resume:n={n}:{d.reason}")
    return ResumeDecision(True, PDP, decode_index, earlier_id, n, f"resume:n={n}")


class ResumeMetrics:
  """Prometheus counters of resumes (registered in the broker's registry)."""

  def __init__(self, registry):
    self.requests = prom.Counter("paas_resumed_requests", "Requests resumed from a commit point "
                            "instead of re-prefilled", ["route"], registry=registry)
    self.saved = prom.Counter("paas_resume_saved_tokens", "Prompt tokens not recomputed thanks "
                         "to a commit point (summed over resumed requests)", registry=registry)
    self.recomputed = prom.Counter("paas_resume_recomputed_tokens", "Prompt tokens recomputed by "
                              "resumed requests", registry=registry)

  def observe(self, route: str, saved_tokens: int, recomputed_tokens: int) -> None:
    if saved_tokens > 0:
      self.requests.labels(route).inc()
    self.saved.inc(max(0, saved_tokens))
    self.recomputed.inc(max(0, recomputed_tokens))
