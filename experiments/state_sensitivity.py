"""How much do the tiny test models' outputs depend on their decode state?

  PYTHONPATH=$PWD .venv/bin/python experiments/state_sensitivity.py \
      --configs=tiny_gdn_gqa,tiny_kda_mla --json_out=runs/state_sensitivity.json

For each config, with the head tied (before, the old configs) and untied (after,
the configs now): over ``--prompts`` random prompts, how often the first
greedy token equals the last prompt token, and how often greedy decoding from
another prompt's state / an all-zero state gives the same ``--new_tokens``
tokens. Then the negative-control table: for each layer kind and corruption of
a handed-off state (``paas_jax.state.sensitivity``), which checks (greedy
tokens, teacher-forced logits, the production logit probe) catch it. And the
cost of the logit probe: one decode step on each side, timed against the
decode step itself. Writes JSON.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from paas_jax.jsonutil import write_json
from paas_jax.models import api, load_config
from paas_jax.serving import common
from paas_jax.state import logit_probe, sensitivity

flags.DEFINE_list("configs", ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa",
                              "tiny_swa_gqa", "tiny_dense_gqa"], "Configs to measure.")
flags.DEFINE_integer("seed", 0, "Weight seed.")
flags.DEFINE_integer("prompts", 12, "Random prompts per config.")
flags.DEFINE_integer("prompt_len", 24, "Tokens per prompt (24: the last KV block is partial).")
flags.DEFINE_integer("new_tokens", 8, "Greedy tokens compared.")
flags.DEFINE_integer("probe_repeats", 20, "Timed repeats of the probe step.")
flags.DEFINE_string("json_out", "runs/state_sensitivity.json", "Where to write the report.")
FLAGS = flags.FLAGS


def _probe_cost(model: api.Model, prompt, repeats: int) -> dict:
  """Seconds of making and of checking a probe vs one plain decode step."""
  _, state = api.prefill(model, np.asarray(prompt, np.int32))
  token = int(prompt[-1])
  probe = logit_probe.make_probe(model, state, token)  # compiles
  logit_probe.check_state(model, state, probe)

  def timed(fn):
    t0 = time.perf_counter()
    for _ in range(repeats):
      fn()
    return (time.perf_counter() - t0) / repeats

  grown = state.grow(logit_probe.probe_capacity(len(prompt)))
  step = timed(lambda: np.asarray(api.decode_step(model, grown, np.asarray([token]))[0]))
  make = timed(lambda: logit_probe.make_probe(model, state, token))
  check = timed(lambda: logit_probe.check_state(model, state, probe))
  return {"decode_step_s": step, "make_probe_s": make, "check_probe_s": check,
          "make_over_step": make / step, "check_over_step": check / step}


def _one(name: str, tie: bool) -> dict:
  config = load_config(name).with_updates(tie_embeddings=tie)
  model = api.Model.create(config, seed=FLAGS.seed)
  prompts = sensitivity.random_prompts(config.vocab_size, FLAGS.prompts, FLAGS.prompt_len,
                                       seed=FLAGS.seed + 1)
  t0 = time.perf_counter()
  out = {"tie_embeddings": tie,
         **sensitivity.measure(model, prompts, FLAGS.new_tokens)}
  h = sensitivity.handoff(model, prompts[:2], FLAGS.new_tokens)
  out["negative_controls"] = sensitivity.negative_controls(model, h)
  out["logit_error_true_state"] = sensitivity.logit_error(model, h.state, h.refs)
  out["probe_cost"] = _probe_cost(model, prompts[0], FLAGS.probe_repeats)
  out["seconds"] = time.perf_counter() - t0
  return out


def main(argv):
  del argv
  common.enable_compilation_cache(common.default_compilation_cache())
  report = {"prompts": FLAGS.prompts, "prompt_len": FLAGS.prompt_len,
            "new_tokens": FLAGS.new_tokens, "logit_steps": sensitivity.LOGIT_STEPS,
            "logit_atol": sensitivity.LOGIT_ATOL, "configs": {}}
  for name in FLAGS.configs:
    before, after = _one(name, True), _one(name, False)
    report["configs"][name] = {"before": before, "after": after}
    for label, r in (("before (tied)", before), ("after (untied)", after)):
      missed = {k: [c for c, caught in v.items() if not caught]
                for k, v in r["negative_controls"].items() if k != "true"}
      print(f"{name} {label}: first==last {r['first_equals_last']}/{r['prompts']}, "
            f"wrong-state same {r['wrong_state_same']}, zero-state same "
            f"{r['zero_state_same']}; missed {({k: v for k, v in missed.items() if v})}")
    write_json(FLAGS.json_out, report)  # after every config: a long sweep keeps its part


if __name__ == "__main__":
  app.run(main)
