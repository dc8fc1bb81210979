"""What per-token logprobs cost the decode pool, side by side in one run.

A real ``DecodeEngine`` (default ``tiny_gdn_gqa``) with every slot active runs
decode steps three ways, interleaved so that machine load hits each alike:

* plain: ``generate()`` (requests without logprobs: no extra device op, no
  extra host transfer; the step's logits stay on the device);
* top-0: ``generate()`` + ``step_logprobs`` (the sampled token's logprob);
* top-20: ``generate()`` + ``step_logprobs`` with 20 alternatives per slot.

Reported: median step milliseconds and the ratios to plain.

Accuracy (``--accuracy_requests`` > 0): through real in-process gRPC servers
(broker, region A's prefill server, region B's decode server, probe on),
requests on both routes, greedy and sampled, each compared with the
single-process reference (``logprob_check``): the largest error per request,
against ``LOGPROB_ATOL``; then the same with a damaged decode-side state
(``corrupt_states`` fault, probe off): the first token's error (prefill side)
and the later steps' error, and whether greedy tokens alone still matched.

  .venv/bin/python experiments/bench_logprobs.py --n_slots=8 --steps=50
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from paas_jax.jsonutil import write_json
from paas_jax.client import BrokerClient
from paas_jax.models import api
from paas_jax.security.faults import FaultPlan
from paas_jax.serving import common, logprob_check
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import RequestParams

CONFIG = flags.DEFINE_string("config", "tiny_gdn_gqa", "model config")
N_SLOTS = flags.DEFINE_integer("n_slots", 8, "decode slots, all active")
STEPS = flags.DEFINE_integer("steps", 50, "timed steps per variant")
PROMPT = flags.DEFINE_integer("prompt_len", 32, "prompt tokens per slot")
ACCURACY = flags.DEFINE_integer("accuracy_requests", 8, "requests of the accuracy check "
                                "(and half as many damaged ones); 0: skip")
OUT = flags.DEFINE_string("out", "runs/bench_logprobs.json", "JSON report")


def accuracy(model, n: int) -> dict:
  """Served logprobs vs the reference through real servers (module docstring)."""
  from paas_jax.serving import broker, decode_server, handoff_probe, prefill_server  # pylint: disable=g-import-not-at-top
  from paas_jax.serving.routing import StaticThresholdPolicy  # pylint: disable=g-import-not-at-top
  ec = EngineConfig(n_slots=2, max_ctx=128, prefill_buckets=(64,), prefill_max_batch=1)
  plan = FaultPlan()
  damage = handoff_probe.fault_hook(FaultPlan(corrupt_states=1 << 30), model.config)
  d = decode_server.start(model, ec, max_queue=4, corrupt_state=(
      lambda rid, st: damage(rid, st) if plan.take_state_corruption() else st))
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(32), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)])
  rng = np.random.default_rng(1)
  good, damaged = [], []
  try:
    with BrokerClient(b.address, timeout_s=120) as client:
      for i in range(n):
        route, temperature = ("remote", "local")[i % 2], (0.0, 0.8)[i * 2 // n]
        prompt = [int(t) for t in rng.integers(1, 256, 60 if route == "remote" else 20)]
        out = client.generate(prompt_ids=prompt, max_new_tokens=6, route=route,
                              temperature=temperature, seed=i, logprobs=True, top_logprobs=5)
        cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
            model, prompt, out.tokens))
        good.append({"route": out.route, "temperature": temperature,
                     "max_error": cmp.max_error, "ok": cmp.ok})
      d.servicer.verifier.enabled = False
      for i in range(max(n // 2, 1)):
        plan.corrupt_states = i + 1  # one more damaged state, for this request
        prompt = [int(t) for t in rng.integers(1, 256, 60)]
        out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                              logprobs=True, top_logprobs=5)
        ref = logprob_check.reference_logprobs(model, prompt, out.tokens)
        later = logprob_check.compare(out.logprobs, ref, range(1, 6))
        damaged.append({
            "first_token_error": logprob_check.compare(out.logprobs, ref, [0]).max_error,
            "later_steps_error": later.max_error, "later_steps_ok": later.ok,
            "greedy_tokens_still_equal": out.tokens == list(
                api.generate(model, prompt, 6).tokens)})
  finally:
    b.stop()
    p.stop()
    d.stop()
  return {"atol": logprob_check.LOGPROB_ATOL, "served": good, "damaged": damaged}


def main(argv):
  del argv
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(CONFIG.value, 0)
  n, steps = N_SLOTS.value, STEPS.value
  variants = {"plain": None, "top0": 0, "top20": 20}
  max_new = len(variants) * (steps + 1) + 4  # every timed and warm-up step fits
  ec = EngineConfig(n_slots=n, max_ctx=PROMPT.value + max_new + 8, prefill_buckets=(64,),
                    prefill_max_batch=1)
  pe, de = PrefillEngine(model, ec), DecodeEngine(model, ec)
  rng = np.random.default_rng(0)
  for i in range(n):
    prompt = tuple(int(t) for t in rng.integers(1, model.config.vocab_size, PROMPT.value))
    out = pe.prefill([PrefillInput(f"r{i}", prompt, RequestParams())])[0]
    slot = de.reserve(len(prompt) + max_new)
    de.insert(out.state, slot, out.first_token, RequestParams(max_new_tokens=max_new))
  times: dict[str, list[float]] = {k: [] for k in variants}
  for round_ in range(steps + 1):  # round 0 compiles every variant, untimed
    for name, top in variants.items():
      t0 = time.perf_counter()
      de.generate()
      if top is not None:
        de.step_logprobs({s: top for s in range(n)})
      if round_:
        times[name].append(time.perf_counter() - t0)
  med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
  report = {"config": CONFIG.value, "n_slots": n, "steps": steps,
            "median_step_ms": med,
            "ratio_top0_to_plain": med["top0"] / med["plain"],
            "ratio_top20_to_plain": med["top20"] / med["plain"]}
  if ACCURACY.value > 0:
    report["accuracy"] = accuracy(model, ACCURACY.value)
  write_json(OUT.value, report)
  print(report)


if __name__ == "__main__":
  app.run(main)
