"""Turning a question into chat messages and then into the prompt text a model sees.

The user message is the question followed, on a new line, by the instruction (by default: reason
step by step and put the final answer in ``\\boxed{}``); an optional system message comes first.
With ``use_chat_template`` the messages go through the tokenizer's chat template with the generation
prompt appended; without it (base models) they are joined by blank lines. ``enable_thinking=False``
is passed to the template as ``enable_thinking=False`` (Qwen3's template then opens the answer with an
empty ``<think></think>`` block, so the model answers without a reasoning trace); templates that do
not read that variable ignore it.

The tokenizer is duck-typed: ``apply_chat_template(messages, add_generation_prompt=True) -> str`` and
``encode(text) -> list[int]`` are all that is used.
"""

from __future__ import annotations

import dataclasses

from areal_jax.chat_template import chat_text

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class PromptFormat:
  """How questions become prompts (the ``task.system_prompt/instruction/use_chat_template`` keys)."""

  system_prompt: str = ""
  instruction: str = DEFAULT_INSTRUCTION
  use_chat_template: bool = True
  enable_thinking: bool = True

  def messages(self, question: str) -> list[dict]:
    """``[{"role": "system", ...}?, {"role": "user", "content": question + instruction}]``."""
    if not isinstance(question, str) or not question.strip():
      raise ValueError(f"a prompt needs a non-empty question string, got {question!r}")
    user = question.strip()
    if self.instruction:
      user = f"{user}\n{self.instruction}"
    out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    out.append({"role": "user", "content": user})
    return out

  def text(self, question: str, tokenizer=None) -> str:
    """The prompt string: the chat template applied, or the plain messages when it is off."""
    msgs = self.messages(question)
    if not self.use_chat_template:
      return "\n\n".join(m["content"] for m in msgs) + "\n"
    if getattr(tokenizer, "apply_chat_template", None) is None:
      raise ValueError(f"task.use_chat_template=True needs a tokenizer with apply_chat_template(); "
                       f"got {type(tokenizer).__name__}. Pass the model's tokenizer or set "
                       f"task.use_chat_template=False")
    out = chat_text(tokenizer, msgs, self.enable_thinking)
    if not isinstance(out, str):
      raise TypeError(f"{type(tokenizer).__name__}.apply_chat_template must return the prompt text "
                      f"(str), got {type(out).__name__}")
    return out

  def ids(self, question: str, tokenizer) -> list[int]:
    """The prompt's token ids (``tokenizer.encode`` of :meth:`text`)."""
    return list(tokenizer.encode(self.text(question, tokenizer)))
