"""The workload, client and summary of ``bench_serve`` (no flags, importable).

``experiments/bench_serve.py`` is the absl launcher; this module holds what it
measures with, so tests and other launchers can import it without defining
flags twice in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib
import time

import aiohttp
import numpy as np

from paas_jax.netem import LinkSpec
from paas_jax.netem.link import parse_rate
from paas_jax.scheduling import TruncatedLogNormal
from paas_jax.serving.launch import ClusterSpec, LocalCluster

PAPER_LO, PAPER_HI, PAPER_T = 128.0, 128.0 * 1024, 19.4 * 1024


# -- workload ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
  prompt: tuple[int, ...]
  output_len: int
  arrival_s: float


def make_workload(rate: float, n: int, *, vocab: int, context: int, output_len: int,
                  output_dist: str, arrival: str, burst_cv: float, mu: float, sigma: float,
                  seed: int) -> list[Request]:
  """Prompts ~ the paper's truncated log-normal scaled to ``context - output_len``."""
  hi = context - output_len
  scale = hi / PAPER_HI
  dist = TruncatedLogNormal(mu + math.log(scale), sigma, max(1.0, PAPER_LO * scale), float(hi))
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(dist.sample(rng, n)), 1, hi).astype(int)
  if arrival == "poisson":
    gaps = rng.exponential(1.0 / rate, n)
  else:  # gamma with the given CV: same mean rate, clumped arrivals
    shape = 1.0 / burst_cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
  arrivals = np.cumsum(gaps) - gaps[0]
  outs = (np.full(n, output_len) if output_dist == "fixed"
          else rng.integers(max(1, output_len // 2), output_len + 1, n))
  return [Request(tuple(int(t) for t in rng.integers(16, vocab, int(l))), int(o), float(a))
          for l, o, a in zip(lengths, outs, arrivals)]


# -- client --------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
  ok: bool
  prompt_len: int
  output_len: int = 0
  ttft_s: float = 0.0
  e2e_s: float = 0.0
  itl_s: list = dataclasses.field(default_factory=list)
  route: str = ""
  error: str = ""

  @property
  def tpot_s(self) -> float:
    return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else 0.0


async def one_request(session, url: str, model: str, req: Request, headers: dict) -> Result:
  body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.output_len,
          "temperature": 0.0, "stream": True, "ignore_eos": True,
          "stream_options": {"include_usage": True}}
  res = Result(ok=False, prompt_len=len(req.prompt))
  t0 = time.perf_counter()
  last = None
  try:
    async with session.post(f"{url}/completions", json=body, headers=headers) as r:
      res.route = r.headers.get("x-paas-route", "")
      if r.status != 200:
        res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
        return res
      async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        event = json.loads(line[6:])
        if "error" in event:
          res.error = str(event["error"])[:200]
          return res
        if event.get("usage"):
          res.output_len = int(event["usage"]["completion_tokens"])
        if any(c.get("text") for c in event.get("choices", [])):
          now = time.perf_counter()
          if last is None:
            res.ttft_s = now - t0
          else:
            res.itl_s.append(now - last)
          last = now
  except Exception as e:  # pylint: disable=broad-except
    res.error = repr(e)[:200]
    return res
  res.e2e_s = time.perf_counter() - t0
  res.ok = last is not None and res.output_len > 0
  return res


async def run_rate(url: str, model: str, reqs: list[Request], headers: dict,
                   timeout_s: float) -> tuple[list[Result], float]:
  timeout = aiohttp.ClientTimeout(total=timeout_s)
  conn = aiohttp.TCPConnector(limit=0, ssl=False)
  async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
    start = time.perf_counter()

    async def fire(req):
      await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
      return await one_request(session, url, model, req, headers)
    results = await asyncio.gather(*(fire(r) for r in reqs))
    return list(results), time.perf_counter() - start


def _pct(xs, qs=(50, 90, 99)) -> dict:
  if not xs:
    return {f"p{q}": None for q in qs} | {"mean": None}
  a = np.asarray(xs) * 1e3
  return {f"p{q}": float(np.percentile(a, q)) for q in qs} | {"mean": float(a.mean())}


def summarize(results: list[Result], wall_s: float, ttft_slo_s: float,
              tpot_slo_s: float) -> dict:
  ok = [r for r in results if r.ok]
  good = [r for r in ok if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s]
  out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
         "errors": sorted({r.error for r in results if r.error})[:5], "wall_s": wall_s,
         "request_throughput": len(ok) / wall_s,
         "output_throughput": sum(r.output_len for r in ok) / wall_s,
         "goodput": len(good) / wall_s, "slo_attainment": len(good) / max(1, len(results)),
         "ttft_ms": _pct([r.ttft_s for r in ok]), "tpot_ms": _pct([r.tpot_s for r in ok]),
         "itl_ms": _pct([x for r in ok for x in r.itl_s]),
         "e2e_ms": _pct([r.e2e_s for r in ok])}
  routes = sorted({r.route for r in ok if r.route})
  if routes:
    out["per_route"] = {rt: {"completed": len(sel), "mean_prompt": float(np.mean(
        [r.prompt_len for r in sel])), "ttft_ms": _pct([r.ttft_s for r in sel]),
        "tpot_ms": _pct([r.tpot_s for r in sel])}
        for rt in routes if (sel := [r for r in ok if r.route == rt])}
  return out



def ratios(results: dict, peer: str) -> dict:
  """paas-jax / peer for each paas-jax target and rate (throughputs: > 1 is
  better; latencies: < 1 is better)."""
  out = {}
  base = {r["rate"]: r for r in results[peer]["rows"]}
  for name, res in results.items():
    if name == peer:
      continue
    rows = []
    for r in res["rows"]:
      b = base.get(r["rate"])
      if b is None:
        continue

      def div(x, y):
        return None if x is None or not y else x / y
      rows.append({"rate": r["rate"],
                   "output_throughput": div(r["output_throughput"], b["output_throughput"]),
                   "goodput": div(r["goodput"], b["goodput"]),
                   **{f"{m}_{q}": div(r[f"{m}_ms"][q], b[f"{m}_ms"][q])
                      for m in ("ttft", "tpot", "e2e") for q in ("p50", "p90", "p99")}})
    out[f"{name}/{peer}"] = rows
  return out


def paas_cluster(checkpoint: str, mode: str, threshold: float, workdir: pathlib.Path, *,
                 n_slots: int, context: int, bandwidth: str = "1gbit",
                 rtt_ms: float = 10.0) -> LocalCluster:
  """Starts paas-jax on an HF checkpoint in bf16 with the OpenAI gateway.

  ``mode``: "single" (everything prefilled in the PD region) or "two" (PrfaaS
  routing at ``threshold`` tokens over an emulated ``bandwidth``/``rtt_ms`` link).
  """
  two = mode == "two"
  spec = ClusterSpec(checkpoint=checkpoint, dtype="bfloat16", n_slots=n_slots,
                     max_ctx=context, prefill_buckets=(64, 256), http=True,
                     threshold=threshold if two else float("inf"),
                     link=(LinkSpec(bandwidth_bps=parse_rate(bandwidth), rtt_s=rtt_ms / 1e3)
                           if two else None))
  return LocalCluster(spec, workdir / f"paas_{mode}").start()
