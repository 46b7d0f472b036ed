"""Speculative decoding on the device (vLLM's v1/spec_decode/ in spirit): one module per proposer
beside a plain step and a plain runner that never branch on the method.

  contract.py     what a speculative step adds to jaxinfer/step.py's contract: SpecInputs,
                  SpecStepInputs / SpecStepOutputs / SpecStepSettings, the TargetDraft and
                  TargetHeads pairs the params travel as
  draft_model.py  the draft model's proposals (`propose`) and its draws
  ngram.py        prompt lookup on the device (`ngram_lookup`, `propose`)
  medusa.py       Medusa heads (`propose`), static trees, tree verification, the heads' checkpoint
  verification.py exact verification of a chain (`verify`) and the batch of a tree's paths
  rounds.py       a multi-round step's draws and outputs (shared by the two steps)
  chain_step.py   the draft-model / n-gram step: proposals, verification, several rounds per call
  medusa_step.py  the Medusa step: tree attention, verification, the accepted K/V moved, next trees
  runner_side.py  the runner's half: params / pages pairs, settings, the step's SpecInputs (numpy)

The host side (the scheduler's proposer, acceptance counters) is jaxinfer/host/speculative.py, which
never imports jax. `jit_spec_step` is the one door from the runner to the step programs.
"""
from __future__ import annotations

from jaxinfer.spec_decode import chain_step, medusa_step
from jaxinfer.spec_decode.contract import SpecStepSettings
from jaxinfer.step import jit_step

# the step program of each method (host/speculative.METHODS)
STEP_FUNCTIONS = {"draft": chain_step.step, "ngram": chain_step.step, "medusa": medusa_step.step}


def jit_spec_step(settings: SpecStepSettings):
    """The jitted speculative step for these settings (step.jit_step: pages donated, one per runner)."""
    return jit_step(settings, STEP_FUNCTIONS[settings.method])
