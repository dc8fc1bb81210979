"""The two-region demo's workload, fault injection, reference and report parts.

Flag-free (``demo_two_region.py`` holds the flags and the run), so that tests
and other launchers can import it without defining the demo's absl flags.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time

import grpc
import numpy as np

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.netem import LinkSpec, describe
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.scheduling import TruncatedLogNormal
from paas_jax.security.faults import FlakyLink
from paas_jax.serving import common
from paas_jax.serving.tokenizer import checkpoint_text

PAPER_LO, PAPER_HI, PAPER_T = 128.0, 128.0 * 1024, 19.4 * 1024


@dataclasses.dataclass
class Req:
  index: int
  prompt: list[int]
  temperature: float
  top_k: int
  top_p: float
  seed: int
  arrival_s: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  ttft_s: float = 0.0
  tpot_s: float = 0.0
  total_s: float = 0.0
  summary: dict = dataclasses.field(default_factory=dict)
  error: str = ""
  region: str = "b"
  reference: list[int] | None = None


def make_workload(config, n: int, max_new: int, context: int, seed: int, *, rate: float,
                  length_mu: float, length_sigma: float, shared_prefix_tokens: int = 0):
  """Prompts whose lengths follow the paper's truncated log-normal, scaled so
  that the paper's 128K maximum becomes ``context - max_new``; Poisson arrivals
  at ``rate`` requests/s; every prompt starts with the same
  ``shared_prefix_tokens`` tokens.

  Returns (requests, the scaled length distribution, the scale).
  """
  hi = context - max_new
  scale = hi / PAPER_HI
  dist = TruncatedLogNormal(length_mu + math.log(scale), length_sigma,
                            max(1.0, PAPER_LO * scale), float(hi))
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(dist.sample(rng, n)), 1, hi).astype(int)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
  arrivals -= arrivals[0]
  shared = min(max(shared_prefix_tokens, 0), hi - 1)
  prefix = rng.integers(0, config.vocab_size, shared).tolist() if shared else []
  reqs = []
  for i, length in enumerate(lengths):
    greedy = i % 2 == 0
    own = max(1, min(int(length), hi - shared))
    reqs.append(Req(index=i,
                    prompt=prefix + rng.integers(0, config.vocab_size, own).tolist(),
                    temperature=0.0 if greedy else 0.8, top_k=0 if greedy else 40,
                    top_p=1.0 if greedy else 0.95, seed=int(rng.integers(0, 2**31 - 1)),
                    arrival_s=float(arrivals[i])))
  return reqs, dist, scale


def run_workload(addresses: dict[str, str], reqs: list[Req], max_new: int, bar,
                 credentials=None) -> float:
  """Sends each request to its region's broker (``addresses``: region -> address)."""
  clients = {region: BrokerClient(a, timeout_s=300, credentials=credentials)
             for region, a in addresses.items()}
  lock = threading.Lock()

  def one(r: Req):
    try:
      out = clients[r.region].generate(prompt_ids=r.prompt, max_new_tokens=max_new,
                            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            seed=r.seed, request_id=f"demo-{r.index:03d}")
      r.tokens, r.ttft_s, r.tpot_s, r.total_s = out.tokens, out.ttft_s, out.tpot_s, out.total_s
      r.summary = out.summary
    except GenerationError as e:
      r.error = str(e)
    with lock:
      if bar is not None:
        bar.update(1)
        bar.set_postfix_str(f"last: {r.summary.get('route', 'error')} "
                            f"ttft {r.ttft_s * 1e3:.0f} ms")

  t0 = time.perf_counter()
  threads = []
  for r in reqs:
    delay = r.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
      time.sleep(delay)
    t = threading.Thread(target=one, args=(r,), daemon=True)
    t.start()
    threads.append(t)
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  for client in clients.values():
    client.close()
  return wall


def wait_partial_commit(cluster, timeout_s: float) -> str:
  """Polls the broker until a request in flight has a partial commit point
  (0 < commit point < prompt); returns its id ("" after ``timeout_s``)."""
  deadline = time.monotonic() + timeout_s
  with BrokerClient(cluster.broker_address, credentials=cluster.client_credentials()) as c:
    while time.monotonic() < deadline:
      for r in c.stats().get("inflight", []):
        if 0 < int(r.get("commit_point", 0)) < int(r.get("prompt_tokens", 0)):
          return r["request_id"]
      time.sleep(0.05)
  return ""


def inject_fault(cluster, log: list[str], fault: str, at: float, down: float) -> None:
  """Runs ``fault`` (the demo's --fault) against the running cluster, on the
  caller's thread: strikes ``at`` s in, outages last ``down`` s."""
  t0 = time.perf_counter()

  def note(text):
    log.append(f"{time.perf_counter() - t0:6.2f} s: {text}")

  if fault == "kill_prefill":
    # The prefill server kills itself after the first partial commit point.
    code = cluster.procs["prefill"].popen.wait()
    note(f"region A (prefill) died after a commit point, exit status {code}")
    time.sleep(down)
    cluster.restart("prefill", drop_prefix="--faults")
    note("region A restarted on its old port (rejoins through health checks)")
  elif fault == "preempt_prefill":
    time.sleep(at)
    # The notice strikes once a prompt is mid-stream (the broker saw a partial
    # commit point), so that there is a request to hand over; at most 120 s on.
    seen = wait_partial_commit(cluster, timeout_s=120.0)
    cluster.procs["prefill"].popen.send_signal(signal.SIGTERM)
    note("preemption notice (SIGTERM) to region A, grace 0.5 s"
         + (f", {seen} mid-stream" if seen else ", nothing was mid-stream"))
    code = cluster.procs["prefill"].popen.wait()
    note(f"region A (prefill) handed its in-flight requests over and exited ({code})")
    time.sleep(down)
    cluster.restart("prefill", drop_prefix="--faults")
    note("region A restarted on its old port (rejoins through health checks)")
  elif fault == "kill_decode":
    time.sleep(at)
    note(f"SIGKILL region B (decode): exit status {cluster.kill('decode')}")
    time.sleep(down)
    cluster.restart("decode")
    note("region B restarted on its old ports")
  elif fault in ("drop_link", "stall_link"):
    time.sleep(at)
    cluster.wan.outage(down, FlakyLink.CUT if fault == "drop_link" else FlakyLink.BLACKHOLE)
    note(f"WAN link {'reset' if fault == 'drop_link' else 'stalled'} for {down:g} s")


def compute_reference(reqs: list[Req], max_new: int, bar, *, config: str, seed: int,
                      checkpoint: str | None, dtype: str | None,
                      compilation_cache: str | None) -> None:
  """Fills each request's ``reference``: single-process ``api.generate`` with
  its prompt, sampling settings and seed, on the model the regions serve."""
  # JAX is loaded here, after the regions have stopped, not while the demo's
  # parent shares the machine with them.
  from paas_jax.models import api  # pylint: disable=g-import-not-at-top
  common.enable_compilation_cache(compilation_cache or common.default_compilation_cache())
  model, _ = common.load_model(config, seed, checkpoint, dtype)
  stops = ()
  if checkpoint:  # the broker stops at the checkpoint's EOS ids, so does the reference
    stops = checkpoint_text(checkpoint).eos_token_ids
  for r in reqs:
    r.reference = api.generate(model, r.prompt, max_new,
                               sampling=api.SamplingParams(r.temperature, r.top_k, r.top_p),
                               seed=r.seed, stop_tokens=stops).tokens
    if bar is not None:
      bar.update(1)


def summarize(xs) -> dict | None:
  """n, mean, P50, P90 and max of the non-None values (None if there are none)."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return None
  a = np.asarray(xs, float)
  return {"n": len(xs), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
          "p90": float(np.percentile(a, 90)), "max": float(a.max())}


def link_report(stats: dict | None, spec: LinkSpec) -> dict:
  if not stats:
    return {}
  out = {"spec": describe(spec)}
  for name in ("a_to_b", "b_to_a"):
    d = stats.get(name, {})
    out[name] = {k: d.get(k) for k in ("bytes", "busy_s", "active_span_s", "utilization",
                                       "mean_rate_bps")}
  d = stats.get("a_to_b", {})
  bucket = d.get("timeline_bucket_s", 0.1)
  timeline = {int(k): v for k, v in d.get("timeline_bytes", {}).items()}
  if timeline:
    trace = spec.effective_trace
    per_s = {}
    for b, v in timeline.items():
      per_s.setdefault(int(b * bucket), 0)
      per_s[int(b * bucket)] += v
    out["a_to_b_per_second"] = [
        {"t_s": t, "bytes": v,
         "capacity_bytes": None if trace is None else trace.rate_at(t) / 8.0,
         "utilization": None if trace is None else v / max(trace.rate_at(t) / 8.0, 1e-9)}
        for t, v in sorted(per_s.items())]
  return out


def server_stats(cluster, name: str, stub_name: str) -> dict:
  try:
    # As the broker: with TLS, only the broker's certificate may call the regions.
    with cluster.channel(name, as_role="broker") as ch:
      stub = getattr(serving_pb2_grpc, stub_name)(ch)
      return dict(stub.GetStats(serving_pb2.StatsRequest(), timeout=10).gauges)
  except grpc.RpcError as e:
    return {"error": str(e.code())}
