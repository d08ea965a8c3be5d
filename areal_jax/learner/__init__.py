"""The learner: decoupled PPO/GRPO on the learner mesh. Uses the model; never the sampler."""

from areal_jax.learner.learner import Learner, make_optimizer

__all__ = ["Learner", "make_optimizer"]
