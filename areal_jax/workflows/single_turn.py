"""One prompt, one completion, the task's reward: the plain GRPO episode.

The controller runs ``rollout.workflow="single_turn"`` through its grouped fast path (one request
of ``n`` samples per prompt, one shared prefill); this class is the same episode for callers that
drive episodes one by one (e.g. a served endpoint, or tests). Its sample has no loss mask.
"""

from __future__ import annotations

from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows.base import Client, Context, Episode, Workflow


class SingleTurn(Workflow):

  name = "single_turn"

  def run(self, example: dict, ctx: Context, client: Client, params: SamplingParams) -> Episode:
    prompt = ctx.task.prompt_ids(example, ctx.tokenizer)
    sample = client.generate(prompt, params)
    if sample.finish_reason == "error":
      return Episode(sample, 0.0, False, 1, "error")
    reward = float(ctx.reward(ctx.tokenizer.decode(sample.tokens), example))
    return Episode(sample, reward, reward > 0.5, 1, "answered")
