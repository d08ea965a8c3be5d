"""Multi-turn with feedback: a wrong answer gets "wrong, try again" and another turn.

Turn 1 answers the task's prompt. After each turn its text is scored with the task's reward; a
right answer ends the episode, a wrong one gets the feedback message as a new user turn (context
tokens, mask 0) unless ``max_turns`` turns were played or the next prompt would not fit
``Context.max_prompt_len``. A turn cut off by the token budget (finish "length") is scored as it
is and, if wrong, also gets the feedback.

Reward: the final answer's correctness x ``turn_discount ** (turns - 1)``, so a right answer on
the first try is worth most. Only the last turn's text is scored (an earlier wrong answer does not
count against it beyond the discount).
"""

from __future__ import annotations

from areal_jax.rollout_api import SamplingParams
from areal_jax.workflows import chat
from areal_jax.workflows.base import ENDED, Client, Context, Episode, Trajectory, Workflow, turn_params

FEEDBACK = "Your answer is wrong. Please try again, and put your final answer within \\boxed{}."


class MultiTurn(Workflow):

  name = "multi_turn"

  def __init__(self, max_turns: int, turn_discount: float = 1.0, feedback: str = FEEDBACK):
    if max_turns < 1:
      raise ValueError(f"rollout.max_turns={max_turns} must be >= 1")
    if not 0.0 < turn_discount <= 1.0:
      raise ValueError(f"rollout.turn_discount={turn_discount} must be in (0, 1]")
    self.max_turns, self.turn_discount, self.feedback = int(max_turns), float(turn_discount), feedback

  def run(self, example: dict, ctx: Context, client: Client, params: SamplingParams) -> Episode:
    traj = Trajectory(ctx.task.prompt_ids(example, ctx.tokenizer))
    correct, turns, end, finish = False, 0, "max_turns", "stop"
    while True:
      sample = client.generate(traj.context, turn_params(params, turns))
      turns += 1
      if sample.finish_reason == "error":
        return traj.failed(sample, turns)
      traj.add_turn(sample)
      finish = sample.finish_reason
      correct = float(ctx.reward(ctx.tokenizer.decode(sample.tokens), example)) > 0.5
      if correct:
        end = "answered"
        break
      if turns >= self.max_turns:
        end = "max_turns"
        break
      last = sample.tokens[-1] if sample.tokens and finish in ENDED else None
      insert = chat.user_turn_tokens(ctx.task, ctx.tokenizer, example, self.feedback, last)
      if len(traj.context) + len(insert) > ctx.max_prompt_len:
        end = "context"
        break
      traj.add_context(insert, traj.last_version(default=0))
    reward = (self.turn_discount ** (turns - 1)) if correct else 0.0
    return Episode(traj.sample(-1, -1, finish, metadata=dict(turns=turns, end=end)), reward,
                   correct, turns, end)
