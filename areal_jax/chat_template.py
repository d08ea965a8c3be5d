"""A conversation's prompt text through the tokenizer's chat template, with the generation prompt
appended: the one place task prompts, multi-turn workflows, serving and the OPD teacher build it.
Imports nothing heavy (the server builds prompts before JAX may be imported)."""

from __future__ import annotations


def chat_text(tokenizer, messages: list[dict], enable_thinking: bool = True) -> str:
  """``messages`` through ``tokenizer.apply_chat_template``; ``enable_thinking=False`` is passed
  only when off (Qwen3's template then opens the answer with an empty think block; templates that
  do not read the variable ignore it)."""
  kwargs = {} if enable_thinking else {"enable_thinking": False}
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
