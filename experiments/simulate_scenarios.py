r"""Scenarios the paper did not run: PrfaaS-PD vs homogeneous PD vs naive heterogeneous.

  .venv/bin/python experiments/simulate_scenarios.py --out_dir=runs/scenarios \
      --json_out=runs/scenarios/summary.json

Plans the three Table 6 systems with the throughput model on the case-study inputs (plus
``prfaas_pd_static``, PrfaaS-PD without the short-timescale threshold adjustments), then
simulates each scenario at each load on one shared request trace per (scenario, load).
Loads are fractions of PrfaaS-PD's Lambda_max, so 0.85 overloads both baselines.
Writes a JSON summary (TTFT/TPOT P50/P90/P99, SLO attainment, egress) and PNG plots:
``ttft_cdf_<scenario>.png``, ``egress_<scenario>.png`` and ``p90_ttft_summary.png``.

``length_shift`` (in the default run; ~1 s) runs its own systems instead: PrfaaS-PD with the
long-timescale rebalancer moving PD nodes between PD-P and PD-D, re-tuning t only, or off
(``scenarios.length_shift_systems``). Its results go to the JSON's ``"length_shift"`` key
(with the role moves and their drain times) and ``ttft_time_length_shift.png``.
"""

from __future__ import annotations

import dataclasses
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
flags.DEFINE_list("scenarios", list(sc.ALL_SCENARIOS), f"Subset of {sc.ALL_SCENARIOS}.")
flags.DEFINE_list("systems", list(sc.SYSTEMS), f"Subset of {sc.SYSTEMS}.")
flags.DEFINE_list("loads", ["0.5", "0.85"], "Mean arrival rates as fractions of PrfaaS-PD Lambda_max.")
flags.DEFINE_float("duration_s", 600.0, "Arrival window per run (s); the run then drains.")
flags.DEFINE_float("link_gbps", cs.LINK_GBPS, "Nominal PrfaaS <-> PD link capacity (Gbps).")
flags.DEFINE_float("ttft_slo_s", 10.0, "TTFT SLO (s).")
flags.DEFINE_float("tpot_slo_tokens_per_s", cs.TPOT_SLO_TOKENS_PER_S, "TPOT SLO (tokens/s).")
flags.DEFINE_float("context_fraction", 0.3, "Share of the decode step that scales with batch context.")
flags.DEFINE_integer("seed", 0, "Root seed; each (scenario, load) trace derives its own.")
flags.DEFINE_float("rebalance_interval_s", 60.0, "length_shift: how often the rebalancer runs (s).")
flags.DEFINE_integer("rebalance_min_samples", 200, "length_shift: lengths needed per rebalance.")


def _after(res, t0: float):
  """The run restricted to requests arriving at or after ``t0``."""
  return dataclasses.replace(res, records=tuple(r for r in res.records if r.arrival_s >= t0))


def _run_length_shift(case, base, loads, seeds, slo) -> dict:
  lam_ref = base.lambda_max["prfaas_pd"]
  after, ratio = sc.length_shift_after(case)
  systems = sc.length_shift_systems(case, base.configs["prfaas_pd"],
                                    interval_s=FLAGS.rebalance_interval_s,
                                    min_samples=FLAGS.rebalance_min_samples)
  out = {"mu_before": case.system.lengths.mu, "mu_after": after.mu, "rate_ratio_after": ratio,
         "shift_at_s": 0.5 * FLAGS.duration_s, "rebalance_interval_s": FLAGS.rebalance_interval_s,
         "systems": list(systems), "loads": {}}
  runs = {}
  for load, seed in zip(loads, seeds):
    spec, link = sc.scenario("length_shift", case, load * lam_ref, FLAGS.duration_s, link_gbps=FLAGS.link_gbps)
    reqs = generate_requests(spec, np.random.default_rng(seed))
    by_sys = {"arrival_rate_rps_before": load * lam_ref, "arrival_rate_rps_after": load * lam_ref * ratio,
              "requests": len(reqs)}
    runs[load] = {}
    for name, cfg in systems.items():
      res = simulate(sc.with_link(cfg, link), reqs)
      m = summarize(res, slo)
      moves = [dataclasses.asdict(mv) for mv in res.role_moves]
      m.update(role_moves=moves, moves=len(moves), drain_s_total=float(sum(mv["drain_s"] for mv in moves)),
               drain_s_max=float(max((mv["drain_s"] for mv in moves), default=0.0)),
               split_history=[list(x) for x in res.split_history],
               threshold_history=[list(x) for x in res.threshold_history],
               after_shift=summarize(_after(res, spec.shift_at_s), slo),
               last_third=summarize(_after(res, 2.0 * FLAGS.duration_s / 3.0), slo))
      by_sys[name] = m
      runs[load][name] = res
    out["loads"][f"{load:g}"] = by_sys
  _plot_ttft_over_time(os.path.join(FLAGS.out_dir, "ttft_time_length_shift.png"), runs,
                       0.5 * FLAGS.duration_s)
  return out


def _plot_ttft_over_time(path: str, runs: dict, shift_s: float, bin_s: float = 10.0) -> None:
  loads = list(runs)
  fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4), squeeze=False)
  for ax, load in zip(axes[0], loads):
    for (name, res), color in zip(runs[load].items(), ("C0", "C1", "C2", "C3")):
      a = np.array([r.arrival_s for r in res.records])
      t = np.array([r.ttft_s for r in res.records])
      edges = np.arange(0.0, a.max() + bin_s, bin_s)
      idx = np.digitize(a, edges) - 1
      p90 = [np.percentile(t[idx == i], 90) if np.any(idx == i) else np.nan for i in range(edges.size)]
      ax.plot(edges + bin_s / 2, p90, color=color, lw=1.2, label=f"{name} (P90 per {bin_s:g} s)")
      for k, mv in enumerate(res.role_moves):
        ax.axvline(mv.start_s, color=color, ls="--", lw=0.8,
                   label=f"{name}: move start" if k == 0 else None)
    ax.axvline(shift_s, color="k", ls=":", lw=1, label="length shift")
    ax.axhline(FLAGS.ttft_slo_s, color="grey", ls=":", lw=1)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"length_shift, load {load:g} x Lambda_max (each phase)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


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
    if s not in sc.ALL_SCENARIOS:
      raise ValueError(f"unknown scenario {s!r}; choose from {sc.ALL_SCENARIOS}")
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
  plain = [s for s in FLAGS.scenarios if s in sc.SCENARIOS]
  bar = tqdm(total=len(plain) * len(loads) * len(FLAGS.systems), desc="simulating", unit="run")
  length_shift = None
  for si, scen in enumerate(FLAGS.scenarios):
    if scen == "length_shift":
      length_shift = _run_length_shift(case, base, loads, seeds[si * len(loads):(si + 1) * len(loads)], slo)
      continue
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
  if results:
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
  if length_shift is not None:
    out["length_shift"] = length_shift
  with open(json_out, "w") as f:
    json.dump(jsonable(out), f, indent=2, allow_nan=False)

  keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p90_ms", "slo_both_attainment", "egress_gbps_mean")
  print(f"{'scenario':<15}{'load':>5}  {'system':<17}" + "".join(f"{k:>21}" for k in keys))
  for scen, by_load in results.items():
    for load, by_sys in by_load.items():
      for system in FLAGS.systems:
        m = by_sys[system]
        print(f"{scen:<15}{load:>5}  {system:<17}" + "".join(f"{m[k]:>21.3f}" for k in keys))
  if length_shift is not None:
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "slo_both_attainment", "throughput_rps")
    print(f"length_shift: mu {length_shift['mu_before']:g} -> {length_shift['mu_after']:g} at "
          f"{length_shift['shift_at_s']:g} s, rate x{length_shift['rate_ratio_after']:.2f}")
    print(f"{'load':>5}  {'system':<26}" + "".join(f"{k:>21}" for k in keys) + f"{'moves':>7}{'drain_s':>9}"
          + f"{'p90 after':>11}{'p90 last1/3':>13}")
    for load, by_sys in length_shift["loads"].items():
      for system in length_shift["systems"]:
        m = by_sys[system]
        print(f"{load:>5}  {system:<26}" + "".join(f"{m[k]:>21.3f}" for k in keys)
              + f"{m['moves']:>7}{m['drain_s_total']:>9.2f}{m['after_shift']['ttft_p90_s']:>11.2f}"
              + f"{m['last_third']['ttft_p90_s']:>13.2f}")
  print(f"wrote {json_out} and plots to {FLAGS.out_dir} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
  app.run(main)
