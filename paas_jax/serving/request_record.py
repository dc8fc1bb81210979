"""What the broker keeps of one request: ``RequestRecord`` (GetStats' in-flight
and recent records, the ``RequestSummary`` streamed to the client).

Its phase and attempts are its ``RequestLifecycle`` (``request_lifecycle.py``);
the rest are the routing inputs, the nodes, timings and byte counts the
attempts fill in.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

from paas_jax.proto import serving_pb2
from paas_jax.serving.request_lifecycle import RequestLifecycle, RequestPhase


@dataclasses.dataclass
class RequestRecord:
  """One request's lifecycle at the broker."""

  request_id: str
  prompt_tokens: int
  max_new_tokens: int
  # Id of the request at the regions (decode job, transfer): unique per
  # attempt even when a client reuses its own request ids.
  downstream_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
  created: float = dataclasses.field(default_factory=time.time)
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  route: str = ""
  route_reason: str = ""  # audit text: the decision's reason, then fallbacks appended
  route_rule: str = ""  # scheduling.RouteRule value: the branch that chose the route
  threshold_adjustment: str = ""  # scheduling.ThresholdAdjustment value ("" none ran)
  threshold: float = 0.0
  decode_server: str = ""
  prefill_server: str = ""
  first_token_s: float = 0.0
  prefill_s: float = 0.0
  prefill_queue_s: float = 0.0
  prefill_batch_size: int = 0
  # Routing inputs/outputs (adaptive router) and the prefix reused by the
  # server that prefilled (cached_tokens, as it reports it).
  l_pd_cached: int = 0
  l_prfaas_cached: int = 0
  prefix_source: str = ""
  bandwidth_mode: str = ""
  cached_tokens: int = 0
  # Cross-cluster prefix transfer before the prefill (abundant link, longer
  # prefix in the other region): direction ("prfaas->pdp" | "pdp->prfaas"),
  # what crossed, and why it did not ("CODE: message"; the request then
  # prefilled without it).
  prefix_transfer: str = ""
  prefix_transfer_tokens: int = 0
  prefix_transfer_bytes: int = 0
  prefix_transfer_s: float = 0.0
  prefix_transfer_error: str = ""
  prefix_node: int = -1  # the PD node a prefix was shipped to (its PD-P should prefill)
  # The PD nodes whose prefix caches hold l_pd_cached (the probe): a local
  # prefill goes to one of them to reuse it.
  pd_prefix_nodes: tuple = ()
  transfer_s: float = 0.0
  decode_queue_s: float = 0.0
  link_bytes: int = 0
  state_bytes: int = 0
  generated: int = 0
  finish_reason: str = ""
  error: str = ""
  total_s: float = 0.0
  client_gone: bool = False
  # Route pdp prefilled on a PD-P node and decoded on another (PD-D) node: the
  # state moved like a PrfaaS one, inside region B.
  pd_split: bool = False
  reroutes: list = dataclasses.field(default_factory=list)
  # Tokens already sent to the client: a restarted request must reproduce
  # them (sampling is keyed by seed and position) and only sends what follows.
  delivered: list = dataclasses.field(default_factory=list)
  # Of those, the first token streamed early (before its state landed: the
  # decode server's first_token_early): region A sampled it from its own
  # state, so a failed handoff (e.g. the logit probe's DATA_LOSS) may still
  # re-prefill the request; the restart reproduces it and sends what follows.
  early_tokens: int = 0
  prefill_error: tuple | None = None
  prefill_done: threading.Event = dataclasses.field(default_factory=threading.Event)
  # Chunk-pipelined transfer (resume.py): the last commit point region A
  # reported; a resumed attempt's earlier id and the prompt tokens it did not
  # recompute (resumed_tokens) and recomputed.
  commit_point: int = 0
  resumed_from: str = ""
  resumed_tokens: int = 0
  recomputed_tokens: int = 0
  # The phase and attempts (request_lifecycle.py); default: a new request.
  lifecycle: RequestLifecycle | None = None

  def __post_init__(self):
    if self.lifecycle is None:
      self.lifecycle = RequestLifecycle(self.request_id)

  @property
  def phase(self) -> RequestPhase:
    return self.lifecycle.phase

  @property
  def attempts(self) -> int:
    return len(self.lifecycle.attempts)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def summary(self) -> serving_pb2.RequestSummary:
    return serving_pb2.RequestSummary(
        request_id=self.request_id, route=self.route, route_reason=self.route_reason,
        prompt_tokens=self.prompt_tokens, threshold_tokens=self.threshold,
        prefill_server=self.prefill_server, decode_server=self.decode_server,
        first_token_s=self.first_token_s, prefill_s=self.prefill_s,
        prefill_queue_s=self.prefill_queue_s, transfer_s=self.transfer_s,
        decode_queue_s=self.decode_queue_s, link_bytes=self.link_bytes,
        state_bytes=self.state_bytes, generated_tokens=self.generated,
        total_s=self.total_s, finish_reason=self.finish_reason,
        prefill_batch_size=self.prefill_batch_size, cached_tokens=self.cached_tokens,
        prefix_source=self.prefix_source, prefix_transfer_tokens=self.prefix_transfer_tokens,
        prefix_transfer_bytes=self.prefix_transfer_bytes,
        prefix_transfer_s=self.prefix_transfer_s, commit_point=self.commit_point,
        resumed_tokens=self.resumed_tokens, recomputed_tokens=self.recomputed_tokens,
        route_rule=self.route_rule, threshold_adjustment=self.threshold_adjustment)

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in ("t0", "prefill_done", "prefill_error", "delivered", "lifecycle")}
    d["phase"], d["attempts"] = self.phase.value, self.attempts
    d["phases"] = [p.value for p in self.lifecycle.phases]
    d["prefill_error"] = None if self.prefill_error is None else (
        f"{self.prefill_error[0].name}: {self.prefill_error[1]}")
    return d
