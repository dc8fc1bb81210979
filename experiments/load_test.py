"""Bounded overload test of a two-region deployment on loopback.

Starts a broker, a prefill server (region A) and a decode server (region B)
as separate processes (``paas_jax.serving.launch.LocalCluster``), measures
the deployment's capacity with a closed loop, then offers open-loop Poisson
load at 1x, 2x and 4x that capacity. Every phase is bounded in time
(``--phase_s``) and in requests (``--max_requests``); every request carries a
deadline (``--request_timeout_s``).

Each request ends in exactly one of:

* completed: the stream finished; its tokens are checked against a
  reference generated before the load (``wrong_tokens`` counts mismatches);
* rejected: a gRPC status before any token (admission control:
  RESOURCE_EXHAUSTED; or UNAVAILABLE, DEADLINE_EXCEEDED...), by code;
* failed: a gRPC status after some tokens had arrived, by code;
* lost: neither: the stream ended without ``finished`` and without a status,
  or the call was still open ``--drain_s`` after its deadline (a hang).

``accepted`` = sent - rejected. ``lost`` = 0 is the goal. Latencies (TTFT,
end to end) are over completed requests. Memory: the resident set size of
every server process (and of this load generator), sampled every
``--mem_interval_s`` across all phases, plus per-phase start / peak / end.

  python experiments/load_test.py --json_out=runs/load_test.json
  python experiments/load_test.py --json_out=/tmp/l.json --phase_s=5 --multipliers=1,4
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import random
import sys
import threading
import time
from concurrent import futures

from absl import app, flags

# Runnable as a script from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the path fix above)
from experiments.load_accounting import Outcome, summarize

FLAGS = flags.FLAGS
flags.DEFINE_string("json_out", None, "Where to write the results (JSON).", required=True)
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config served.")
flags.DEFINE_integer("n_slots", 8, "Decode slots.")
flags.DEFINE_integer("max_queue", 16, "Decode admission queue (requests waiting for a slot).")
flags.DEFINE_float("threshold", 96, "Prompts longer than this are prefilled remotely.")
flags.DEFINE_list("multipliers", ["1", "2", "4"], "Offered load as multiples of capacity.")
flags.DEFINE_float("phase_s", 10.0, "Arrival window of each open-loop phase.")
flags.DEFINE_integer("max_requests", 1500, "Most requests offered per phase.")
flags.DEFINE_float("capacity_s", 8.0, "Closed-loop capacity measurement window.")
flags.DEFINE_integer("capacity_concurrency", 0, "Closed-loop clients (0: 2 x n_slots).")
flags.DEFINE_integer("prompt_min", 16, "Shortest prompt (tokens).")
flags.DEFINE_integer("prompt_max", 160, "Longest prompt (tokens).")
flags.DEFINE_integer("num_prompts", 12, "Distinct prompts (each gets a reference output).")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per request.")
flags.DEFINE_float("request_timeout_s", 20.0, "Client deadline of each request.")
flags.DEFINE_float("drain_s", 10.0, "Grace after the last deadline before open calls count "
                   "as lost.")
flags.DEFINE_integer("max_outstanding", 768, "Client threads (calls open at once).")
flags.DEFINE_float("mem_interval_s", 0.5, "RSS sampling period.")
flags.DEFINE_integer("seed", 0, "Arrival and prompt seed.")
flags.DEFINE_string("workdir", None, "Cluster logs (default: a temporary directory).")
flags.DEFINE_bool("tls", True, "Run the deployment as it ships: mutual TLS between broker and "
                  "regions, TLS + bearer token at the broker (--notls: plaintext).")


# -- memory --------------------------------------------------------------------------

def rss_bytes(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


class MemorySampler:
  """Samples the RSS of named processes on a background thread."""

  def __init__(self, pids: dict[str, int], interval_s: float):
    self.pids = dict(pids)
    self.interval_s = interval_s
    self.samples: list[dict] = []
    self.phase = "startup"
    self._t0 = time.monotonic()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="mem-sampler", daemon=True)

  def start(self) -> "MemorySampler":
    self._thread.start()
    return self

  def sample(self) -> dict:
    s = {"t_s": round(time.monotonic() - self._t0, 3), "phase": self.phase,
         "rss": {n: rss_bytes(p) for n, p in self.pids.items()}}
    self.samples.append(s)
    return s

  def _loop(self) -> None:
    while not self._stop.wait(self.interval_s):
      self.sample()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)

  def phase_summary(self, phase: str) -> dict:
    rows = [s for s in self.samples if s["phase"] == phase]
    out = {}
    for name in self.pids:
      vals = [s["rss"][name] for s in rows if s["rss"].get(name)]
      if vals:
        out[name] = {"start_mib": vals[0] / 2**20, "peak_mib": max(vals) / 2**20,
                     "end_mib": vals[-1] / 2**20}
    return out


# -- one request ---------------------------------------------------------------------

def run_request(client, prompt: list[int], reference: list[int] | None, timeout_s: float,
                out: Outcome) -> Outcome:
  """Runs one request to its end, filling ``out`` (which the caller may read
  while the call is still open)."""
  from paas_jax.client import GenerationError  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  tokens: list[int] = []
  finished = False
  try:
    for chunk in client.stream(prompt_ids=prompt, max_new_tokens=FLAGS.max_new_tokens,
                               seed=1, timeout_s=timeout_s):
      if chunk.token_ids and out.ttft_s is None:
        out.ttft_s = chunk.arrived_s
      tokens.extend(chunk.token_ids)
      if chunk.summary:
        out.route = chunk.summary.get("route", out.route)
      if chunk.finished:
        finished = True
    if finished:
      out.kind = "completed"
      out.total_s = time.perf_counter() - started
      out.tokens_ok = reference is None or tokens == reference
    else:
      out.kind, out.code = "lost", "ended_without_finish"
  except GenerationError as e:
    out.kind = "failed" if tokens else "rejected"
    out.code = e.code.name
  except Exception as e:  # pylint: disable=broad-except
    out.kind, out.code = "lost", f"client_exception:{type(e).__name__}"
  out.done = True
  return out


# -- load shapes ---------------------------------------------------------------------

def closed_loop(client, prompts, refs, concurrency: int, window_s: float) -> tuple[float, dict]:
  """``concurrency`` clients back to back for ``window_s``: completions per second."""
  stop_at = time.monotonic() + window_s
  outcomes: list[Outcome] = []
  lock = threading.Lock()
  rng = random.Random(FLAGS.seed + 1)

  def worker(i: int):
    local = random.Random(rng.random() + i)
    while time.monotonic() < stop_at:
      p = local.randrange(len(prompts))
      o = run_request(client, prompts[p], refs[p], FLAGS.request_timeout_s, Outcome())
      with lock:
        outcomes.append(o)

  started = time.monotonic()
  threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  elapsed = time.monotonic() - started
  done = sum(1 for o in outcomes if o.kind == "completed")
  return done / elapsed, summarize(outcomes, elapsed)


def open_loop(client, prompts, refs, rate: float, window_s: float, max_requests: int,
              pool: futures.ThreadPoolExecutor) -> tuple[list[Outcome], float, float]:
  """Poisson arrivals at ``rate``/s for ``window_s`` (at most ``max_requests``).

  Returns (outcomes, arrival window, seconds until the last call ended)."""
  rng = random.Random(FLAGS.seed + int(rate * 1000))
  outcomes: list[Outcome] = []
  calls = []
  started = time.monotonic()
  t = 0.0
  while len(outcomes) < max_requests:
    t += rng.expovariate(rate)
    if t > window_s:
      break
    delay = started + t - time.monotonic()
    if delay > 0:
      time.sleep(delay)
    p = rng.randrange(len(prompts))
    o = Outcome()
    outcomes.append(o)
    calls.append(pool.submit(run_request, client, prompts[p], refs[p],
                             FLAGS.request_timeout_s, o))
  window = time.monotonic() - started
  # Every call has a deadline; give them that plus the drain grace, then stop
  # waiting: whatever is still open is a hang and counts as lost.
  futures.wait(calls, timeout=FLAGS.request_timeout_s + FLAGS.drain_s)
  return outcomes, window, time.monotonic() - started


# -- main ----------------------------------------------------------------------------

def main(argv):
  del argv
  from paas_jax.client import BrokerClient  # pylint: disable=g-import-not-at-top
  from paas_jax.serving.launch import ClusterSpec, LocalCluster  # pylint: disable=g-import-not-at-top

  spec = ClusterSpec(config=FLAGS.config, n_slots=FLAGS.n_slots, max_queue=FLAGS.max_queue,
                     threshold=FLAGS.threshold, prefill_buckets=(64, 256), tls=FLAGS.tls,
                     router="static")
  rng = random.Random(FLAGS.seed)
  t_start = time.monotonic()
  result: dict = {"flags": {k: getattr(FLAGS, k) for k in (
      "config", "n_slots", "max_queue", "threshold", "multipliers", "phase_s", "max_requests",
      "capacity_s", "prompt_min", "prompt_max", "max_new_tokens", "request_timeout_s",
      "drain_s", "seed", "tls")}, "host": {"cpus": os.cpu_count(), "python": platform.python_version()}}

  with LocalCluster(spec, FLAGS.workdir) as cluster:
    result["startup_s"] = round(time.monotonic() - t_start, 2)
    pids = {name: p.popen.pid for name, p in cluster.procs.items()}
    pids["load_generator"] = os.getpid()
    sampler = MemorySampler(pids, FLAGS.mem_interval_s).start()
    vocab_hi = 250
    prompts = [[rng.randrange(1, vocab_hi) for _ in range(rng.randint(FLAGS.prompt_min,
                                                                      FLAGS.prompt_max))]
               for _ in range(FLAGS.num_prompts)]
    with BrokerClient(cluster.broker_address, timeout_s=FLAGS.request_timeout_s,
                      credentials=cluster.client_credentials()) as client:
      # References: each prompt once, unloaded, both routes must agree.
      sampler.phase = "reference"
      refs, route_mismatch = [], 0
      for p in prompts:
        outs = [client.generate(prompt_ids=p, max_new_tokens=FLAGS.max_new_tokens, seed=1,
                                route=r) for r in ("local", "remote")]
        route_mismatch += outs[0].tokens != outs[1].tokens
        refs.append(outs[0].tokens)
      result["reference"] = {"prompts": len(prompts), "local_vs_remote_mismatch": route_mismatch,
                             "prompt_lengths": [len(p) for p in prompts]}

      sampler.phase = "capacity"
      concurrency = FLAGS.capacity_concurrency or 2 * FLAGS.n_slots
      capacity, cap_summary = closed_loop(client, prompts, refs, concurrency, FLAGS.capacity_s)
      result["capacity"] = {"completed_per_s": round(capacity, 3), "concurrency": concurrency,
                            **cap_summary, "memory": sampler.phase_summary("capacity")}
      print(f"capacity: {capacity:.2f} completed/s at concurrency {concurrency}", flush=True)

      phases = []
      with futures.ThreadPoolExecutor(max_workers=FLAGS.max_outstanding,
                                      thread_name_prefix="load") as pool:
        for m in [float(x) for x in FLAGS.multipliers]:
          name = f"{m:g}x"
          sampler.phase = name
          rate = max(capacity * m, 0.1)
          outcomes, window, span = open_loop(client, prompts, refs, rate, FLAGS.phase_s,
                                             FLAGS.max_requests, pool)
          summary = summarize(outcomes, window)
          try:
            gauges = {k: v for k, v in client.stats().items() if isinstance(v, (int, float))}
          except Exception as e:  # pylint: disable=broad-except
            gauges = {"error": repr(e)}
          phases.append({"multiplier": m, "offered_per_s": round(rate, 3),
                         "arrival_window_s": round(window, 2), "span_s": round(span, 2),
                         **summary, "memory": sampler.phase_summary(name),
                         "broker_gauges": gauges})
          print(f"{name}: offered {rate:.1f}/s sent {summary['sent']} completed "
                f"{summary['completed']} rejected {summary['rejected']} "
                f"{summary['rejected_by_code']} failed {summary['failed']} lost "
                f"{summary['lost']} p50 {summary['latency_ms']['p50']} ms p99 "
                f"{summary['latency_ms']['p99']} ms", flush=True)
      sampler.phase = "after"
      time.sleep(max(2 * FLAGS.mem_interval_s, 1.0))
      sampler.sample()
      # Still serving after the overload: one more request completes correctly.
      final = run_request(client, prompts[0], refs[0], FLAGS.request_timeout_s, Outcome())
      result["after_overload"] = {"kind": final.kind, "code": final.code,
                                  "tokens_ok": final.tokens_ok}
    sampler.stop()
    result["phases"] = phases
    result["memory_timeline"] = sampler.samples
    servers = [n for n in pids if n != "load_generator"]
    first = phases[0]["memory"] if phases else {}
    last = sampler.samples[-1]["rss"] if sampler.samples else {}
    result["memory_growth_mib"] = {
        n: round((last[n] or 0) / 2**20 - first[n]["end_mib"], 1)
        for n in servers if n in first and last.get(n)}
  result["lost_total"] = sum(p["lost"] for p in phases)
  result["wall_s"] = round(time.monotonic() - t_start, 1)
  path = pathlib.Path(FLAGS.json_out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1))
  print(f"wrote {path}: lost {result['lost_total']}, memory growth "
        f"{result['memory_growth_mib']} MiB", flush=True)


if __name__ == "__main__":
  app.run(main)
