r"""Scenarios the paper did not run: PrfaaS-PD vs homogeneous PD vs naive heterogeneous.

  .venv/bin/python experiments/simulate_scenarios.py --out_dir=runs/scenarios \
      --json_out=runs/scenarios/summary.json

Plans the three Table 6 systems with the throughput model on the case-study inputs (plus
``prfaas_pd_static``, PrfaaS-PD without the short-timescale threshold adjustments), then
simulates each scenario at each load on one shared request trace per (scenario, load).
Loads are fractions of PrfaaS-PD's Lambda_max, so 0.85 overloads both baselines.
Writes a JSON summary (TTFT/TPOT P50/P90/P99, SLO attainment, egress) and PNG plots:
``ttft_cdf_<scenario>.png``, ``egress_<scenario>.png`` and ``p90_ttft_summary.png``.
"""

from __future__ import annotations

import json
import math
import os
import time

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from paas_jax.jsonutil import jsonable
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from paas_jax.scheduling import case_study as cs  # noqa: E402
from paas_jax.simulation import SloSpec, generate_requests, simulate, summarize  # noqa: E402
from paas_jax.simulation import scenarios as sc  # noqa: E402
from paas_jax.simulation.link import BandwidthTrace  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "runs/scenarios", "Folder for the PNG plots (and the default JSON).")
flags.DEFINE_string("json_out", None, "JSON summary path; default <out_dir>/summary.json.")
flags.DEFINE_list("scenarios", list(sc.SCENARIOS), f"Subset of {sc.SCENARIOS}.")
flags.DEFINE_list("systems", list(sc.SYSTEMS), f"Subset of {sc.SYSTEMS}.")
flags.DEFINE_list("loads", ["0.5", "0.85"], "Mean arrival rates as fractions of PrfaaS-PD Lambda_max.")
flags.DEFINE_float("duration_s", 600.0, "Arrival window per run (s); the run then drains.")
flags.DEFINE_float("link_gbps", cs.LINK_GBPS, "Nominal PrfaaS <-> PD link capacity (Gbps).")
flags.DEFINE_float("ttft_slo_s", 10.0, "TTFT SLO (s).")
flags.DEFINE_float("tpot_slo_tokens_per_s", cs.TPOT_SLO_TOKENS_PER_S, "TPOT SLO (tokens/s).")
flags.DEFINE_float("context_fraction", 0.3, "Share of the decode step that scales with batch context.")
flags.DEFINE_integer("seed", 0, "Root seed; each (scenario, load) trace derives its own.")


def _plot_ttft_cdfs(path: str, scenario: str, loads, ttfts: dict) -> None:
  fig, axes = plt.subplots(1, len(loads), figsize=(5.5 * len(loads), 4), squeeze=False)
  for ax, load in zip(axes[0], loads):
    for system, x in ttfts[load].items():
      x = np.sort(x)
      ax.plot(x, np.arange(1, x.size + 1) / x.size, label=system)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.set_title(f"{scenario}, load {load:g} x Lambda_max(PrfaaS-PD)")
    ax.axvline(FLAGS.ttft_slo_s, color="grey", ls=":", lw=1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _plot_egress(path: str, scenario: str, loads, series: dict, link: BandwidthTrace,
                 horizon: float) -> None:
  fig, axes = plt.subplots(1, len(loads), figsize=(5.5 * len(loads), 3.6), squeeze=False)
  for ax, load in zip(axes[0], loads):
    for system, (bin_s, gbps) in series[load].items():
      if gbps.size:
        # Trailing 10-bin average: single KV bursts run at line rate and hide the trend.
        c = np.concatenate([[0.0], np.cumsum(gbps)])
        idx = np.arange(1, gbps.size + 1)
        lo = np.maximum(idx - 10, 0)
        smooth = (c[idx] - c[lo]) / (idx - lo)
        ax.plot(np.arange(gbps.size) * bin_s, smooth, label=f"{system} (10 s avg)", lw=1)
    t = np.linspace(0, horizon, 2000)
    ax.plot(t, [link.at(x) / 1e9 for x in t], color="k", ls="--", lw=1, label="link capacity")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("PrfaaS egress (Gbps)")
    ax.set_yscale("log")
    ax.set_title(f"{scenario}, load {load:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _plot_summary(path: str, results: dict, loads, systems) -> None:
  scen = list(results)
  fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4), squeeze=False)
  width = 0.8 / len(systems)
  for ax, load in zip(axes[0], loads):
    for i, system in enumerate(systems):
      vals = [results[s][f"{load:g}"][system]["ttft_p90_s"] for s in scen]
      ax.bar(np.arange(len(scen)) + i * width, vals, width, label=system)
    ax.set_xticks(np.arange(len(scen)) + 0.4 - width / 2)
    ax.set_xticklabels(scen, rotation=20, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("P90 TTFT (s)")
    ax.set_title(f"load {load:g} x Lambda_max(PrfaaS-PD)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  t0 = time.time()
  for s in FLAGS.scenarios:
    if s not in sc.SCENARIOS:
      raise ValueError(f"unknown scenario {s!r}; choose from {sc.SCENARIOS}")
  for s in FLAGS.systems:
    if s not in sc.SYSTEMS:
      raise ValueError(f"unknown system {s!r}; choose from {sc.SYSTEMS}")
  loads = [float(x) for x in FLAGS.loads]
  if any(not (x > 0 and math.isfinite(x)) for x in loads):
    raise ValueError(f"loads must be positive: {loads}")
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  json_out = FLAGS.json_out or os.path.join(FLAGS.out_dir, "summary.json")
  slo = SloSpec(ttft_s=FLAGS.ttft_slo_s, tpot_s=1.0 / FLAGS.tpot_slo_tokens_per_s)

  case = cs.build_case_study(link_gbps=FLAGS.link_gbps)
  base = sc.plan_systems(case, BandwidthTrace.constant(FLAGS.link_gbps * 1e9),
                         context_fraction=FLAGS.context_fraction)
  lam_ref = base.lambda_max["prfaas_pd"]
  results: dict = {}
  seeds = np.random.SeedSequence(FLAGS.seed).spawn(len(FLAGS.scenarios) * len(loads))
  bar = tqdm(total=len(FLAGS.scenarios) * len(loads) * len(FLAGS.systems), desc="simulating", unit="run")
  for si, scen in enumerate(FLAGS.scenarios):
    results[scen] = {}
    ttfts, series = {}, {}
    link = None
    for li, load in enumerate(loads):
      spec, link = sc.scenario(scen, case, load * lam_ref, FLAGS.duration_s, link_gbps=FLAGS.link_gbps)
      reqs = generate_requests(spec, np.random.default_rng(seeds[si * len(loads) + li]))
      results[scen][f"{load:g}"] = {"arrival_rate_rps": load * lam_ref, "requests": len(reqs)}
      ttfts[load], series[load] = {}, {}
      for system in FLAGS.systems:
        bar.set_postfix_str(f"{scen} {load:g} {system}")
        res = simulate(sc.with_link(base.configs[system], link), reqs)
        results[scen][f"{load:g}"][system] = summarize(res, slo)
        ttfts[load][system] = np.array([r.ttft_s for r in res.records])
        if system != "homogeneous":
          series[load][system] = (res.egress_bin_s, sc.egress_gbps_series(res.egress_bin_s,
                                                                           res.egress_bytes_per_bin))
        bar.update(1)
    _plot_ttft_cdfs(os.path.join(FLAGS.out_dir, f"ttft_cdf_{scen}.png"), scen, loads, ttfts)
    horizon = max((s[1].size * s[0] for d in series.values() for s in d.values()), default=FLAGS.duration_s)
    _plot_egress(os.path.join(FLAGS.out_dir, f"egress_{scen}.png"), scen, loads, series, link, horizon)
  bar.close()
  _plot_summary(os.path.join(FLAGS.out_dir, "p90_ttft_summary.png"), results, loads, FLAGS.systems)

  out = {
      "config": {"duration_s": FLAGS.duration_s, "loads_fraction_of_prfaas_lambda_max": loads,
                 "link_gbps": FLAGS.link_gbps, "ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s,
                 "context_fraction": FLAGS.context_fraction, "seed": FLAGS.seed},
      "planned": {name: {"lambda_max_rps": base.lambda_max[name], "threshold_tokens": base.thresholds[name],
                         "deployment": [cfg.deployment.n_prfaas, cfg.deployment.n_pdp, cfg.deployment.n_decode]}
                  for name, cfg in base.configs.items()},
      "assumptions": case.assumptions,
      "results": results,
  }
  with open(json_out, "w") as f:
    json.dump(jsonable(out), f, indent=2, allow_nan=False)

  keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p90_ms", "slo_both_attainment", "egress_gbps_mean")
  print(f"{'scenario':<15}{'load':>5}  {'system':<17}" + "".join(f"{k:>21}" for k in keys))
  for scen, by_load in results.items():
    for load, by_sys in by_load.items():
      for system in FLAGS.systems:
        m = by_sys[system]
        print(f"{scen:<15}{load:>5}  {system:<17}" + "".join(f"{m[k]:>21.3f}" for k in keys))
  print(f"wrote {json_out} and plots to {FLAGS.out_dir} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
  app.run(main)
