"""The learner: decoupled PPO/GRPO on the learner mesh. Uses the model; never the sampler."""

from areal_jax.learner import advantages, loss, packing
from areal_jax.learner.learner import Learner, make_optimizer, make_schedule

__all__ = ["Learner", "advantages", "loss", "make_optimizer", "make_schedule", "packing"]
