"""Token-level teaching in the train batch: hindsight-guided on-policy distillation (OPD).

A sample may come with a ``TokenTeacher``: a teacher's logprob of each of its generated tokens
(scored under a prompt the policy did not see, e.g. with a hint from what came next) and a weight.
The learner packs them beside the batch (``pack``: aligned to the scoring positions, like every
per-token array) and, after its own forward, turns them into training signal (``terms``):
  * token level (``topk = 0``): the advantage of token t becomes
    ``adv + weight * (teacher_logp_t - student_logp_t)`` on trained (mask 1) tokens, 0 elsewhere,
    fed to the same clipped objective; the student's logprob is the proximal policy's, recomputed
    by the learner (no gradient through it);
  * top-k (``topk = k``): the teacher's k most likely tokens at each position and their logprobs;
    the loss gains ``weight * KL(student || teacher)`` over k + 1 bins (the k tokens and the rest
    of the mass), the student's logprobs of those tokens coming from the learner's forward (with
    gradient). The scalar advantage still goes through the clipped objective.
A sample without a teacher gets weight 0: its tokens train on the scalar advantage alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class TokenTeacher:
  """A teacher's view of one sample's generated tokens."""
  logprobs: list[float]  # the teacher's logprob of each generated token
  weight: float = 1.0  # how much the teacher's term counts (serve.signal_w_opd)
  topk_ids: list[list[int]] | None = None  # [tokens][k]: the teacher's k most likely tokens
  topk_logprobs: list[list[float]] | None = None  # [tokens][k]: their logprobs


def fields(topk: int | None) -> tuple[str, ...]:
  """The batch arrays a learner built with ``distill_topk = topk`` carries (None: none)."""
  if topk is None:
    return ()
  return ("teacher_logp", "opd_w") + (("topk_ids", "topk_logp") if topk else ())


def pack(seq_RxL: np.ndarray, teachers: list[TokenTeacher | None], topk: int) -> dict:
  """The teacher arrays of packed rows whose ``seq_RxL`` (``packing.Packed.seq``) names the sequence
  scored at each position (-1: none); ``teachers[i]`` belongs to sequence ``i``. A sequence's
  positions, in order, score its generated tokens 0, 1, ..."""
  r, l = seq_RxL.shape
  out = {"teacher_logp": np.zeros((r, l), np.float32), "opd_w": np.zeros((r, l), np.float32)}
  if topk:
    out["topk_ids"] = np.zeros((r, l, topk), np.int32)
    # an absent teacher's bins: uniform, weight 0 (finite, no gradient reaches them)
    out["topk_logp"] = np.full((r, l, topk), -np.log(2.0 * topk), np.float32)
  for row in range(r):
    for i in np.unique(seq_RxL[row][seq_RxL[row] >= 0]):
      t = teachers[int(i)]
      if t is None:
        continue
      at = np.flatnonzero(seq_RxL[row] == i)
      if len(t.logprobs) != len(at):
        raise ValueError(f"sequence {int(i)}: {len(t.logprobs)} teacher logprobs for {len(at)} "
                         f"generated tokens")
      out["teacher_logp"][row, at] = t.logprobs
      out["opd_w"][row, at] = t.weight
      if topk:
        ids, logp = np.asarray(t.topk_ids), np.asarray(t.topk_logprobs, np.float32)
        if ids.shape != (len(at), topk) or logp.shape != (len(at), topk):
          raise ValueError(f"sequence {int(i)}: the teacher's top-k must be [{len(at)}, {topk}], "
                           f"got ids {ids.shape} and logprobs {logp.shape}")
        out["topk_ids"][row, at] = ids
        out["topk_logp"][row, at] = logp
  return out


def token_advantage(adv_BxL, teacher_logp_BxL, student_logp_BxL, opd_w_BxL, mask_BxL):
  """``adv + w * (teacher - student)`` where the mask trains a token, 0 elsewhere (no gradient)."""
  d = opd_w_BxL * (teacher_logp_BxL - jax.lax.stop_gradient(student_logp_BxL))
  return jnp.where(mask_BxL > 0, adv_BxL + d, 0.0)


def _with_rest(logp_BxLxK):
  """The k logprobs and the rest of the mass, ``log(1 - sum p)``, as k + 1 bins."""
  rest = jnp.log(jnp.maximum(-jnp.expm1(jax.nn.logsumexp(logp_BxLxK, axis=-1)), 1e-12))
  return jnp.concatenate([logp_BxLxK, rest[..., None]], axis=-1)


def topk_reverse_kl(student_BxLxK, teacher_BxLxK):
  """``KL(student || teacher)`` per position over the k + 1 bins."""
  s, t = _with_rest(student_BxLxK), _with_rest(teacher_BxLxK)
  return jnp.sum(jnp.exp(s) * (s - t), axis=-1)


def terms(b: dict, student_logp_BxL, student_topk_BxLxK=None, *, n_tokens):
  """``(advantage, extra loss)`` of micro-batch ``b`` after the learner's forward: ``b["adv"]``
  and 0 when it carries no teacher; else the module docstring's terms (the loss summed over
  trained tokens and divided by the minibatch's ``n_tokens``, like the PPO loss)."""
  if "opd_w" not in b:
    return b["adv"], 0.0
  if "topk_ids" not in b:
    return token_advantage(b["adv"], b["teacher_logp"], student_logp_BxL, b["opd_w"],
                           b["mask"]), 0.0
  kl = topk_reverse_kl(student_topk_BxLxK, b["topk_logp"])
  extra = jnp.sum(jnp.where(b["mask"] > 0, b["opd_w"] * kl, 0.0)) / jnp.maximum(n_tokens, 1.0)
  return b["adv"], extra
