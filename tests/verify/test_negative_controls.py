"""Negative controls: every check the serving tests rely on fails on a corrupted
state, one layer kind and one corruption at a time, and passes on the true one."""

import numpy as np
import pytest

from paas_jax.models import load_config
from paas_jax.state import logit_probe, sensitivity
from tests import verify

CONFIGS = ([pytest.param(n) for n in verify.FAST_CONFIGS]
           + [pytest.param(n, marks=pytest.mark.slow) for n in verify.SLOW_CONFIGS])
TINY = verify.FAST_CONFIGS + verify.SLOW_CONFIGS


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_have_untied_heads(name):
  assert load_config(name).tie_embeddings is False


@pytest.mark.parametrize("name", CONFIGS)
def test_true_state_passes_every_check(name):
  assert verify.controls(name)["true"] == {c: True for c in sensitivity.CHECKS}


@pytest.mark.parametrize("name", CONFIGS)
def test_logit_checks_catch_every_corruption(name):
  """Teacher-forced logits and the production probe catch every corruption of
  every layer kind of the model."""
  table = verify.controls(name)
  kinds = set(load_config(name).layer_kinds)
  expected = {f"{k}/{c}" for k in kinds for c in sensitivity.APPLIES[k]}
  assert set(table) - {"true"} == expected
  missed = {case: [c for c in ("logits", "probe") if not caught[c]]
            for case, caught in table.items() if case != "true"}
  assert not {k: v for k, v in missed.items() if v}, missed


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_catch_lost_and_wrong_states(name):
  """Tokens alone catch a zeroed or swapped state of every kind (the failure of
  the tied models); subtler KV damage (a dropped block, an offset) needs the
  logit checks above, which is why the serving path runs the probe."""
  table = verify.controls(name)
  missed = [case for case, caught in table.items()
            if case.split("/")[-1] in ("zero", "swap") and not caught["tokens"]]
  assert not missed


def test_untied_model_reacts_to_its_state():
  """The measurement of issue #12 on the serving tests' model: no echo of the last
  prompt token, and another prompt's or a zeroed state changes the output."""
  name = "tiny_gdn_gqa"
  got = sensitivity.measure(verify.model(name), verify.prompts(name, 6, seed=2),
                            verify.NEW_TOKENS)
  assert (got["first_equals_last"], got["wrong_state_same"], got["zero_state_same"]) == (
      0, 0, 0), got


@pytest.mark.slow
def test_tied_model_fails_the_same_measurement():
  """Negative control of the measurement itself: the old tied head echoes."""
  name = "tiny_gdn_gqa"
  got = sensitivity.measure(verify.model(name, tie_embeddings=True),
                            verify.prompts(name, 6, seed=2), verify.NEW_TOKENS)
  assert got["first_equals_last"] >= 5 and got["wrong_state_same"] >= 3, got


def test_reference_matches_plain_decode_within_tolerance():
  """The full-prefill reference logits and the decode path agree on the true
  state far inside LOGIT_ATOL (so the tolerance is not what hides corruptions)."""
  name = "tiny_gdn_gqa"
  h = verify.handoff(name)
  err = sensitivity.logit_error(verify.model(name), h.state, h.refs)
  assert err < sensitivity.LOGIT_ATOL / 10


def test_probe_compare_rejects_each_kind_of_difference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=256).astype(np.float32) * 3
  probe = logit_probe.fingerprint(logits, token=5, dtype="float32")
  assert logit_probe.compare(probe, logits).ok
  assert logit_probe.compare(probe, logits + 1e-4).ok  # inside the f32 tolerance
  moved = logits.copy()
  moved[probe.ids[3]] += 0.05
  r = logit_probe.compare(probe, moved)
  assert not r.ok and f"token {probe.ids[3]}" in r.reason
  intruder = logits.copy()
  outside = int(np.setdiff1d(np.arange(256), probe.ids)[0])
  intruder[outside] = logits.max() + 1
  r = logit_probe.compare(probe, intruder)
  assert not r.ok and f"token {outside} rose" in r.reason
  assert not logit_probe.compare(probe, np.full(256, np.nan, np.float32)).ok
  bf16 = logit_probe.fingerprint(logits, token=5, dtype="bfloat16")
  assert logit_probe.tolerance(bf16) > logit_probe.tolerance(probe)
  assert logit_probe.compare(bf16, moved).ok  # 0.05 is within bf16 rounding of |x|~9
