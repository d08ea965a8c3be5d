"""Prompt construction from the task config, with a small fake tokenizer."""

import pytest

from areal_jax import config as config_lib
from areal_jax.tasks import get_task, task_settings
from areal_jax.tasks.prompts import DEFAULT_INSTRUCTION, PromptFormat

EXAMPLE = {"id": "q1", "question": "  Tom has 3 apples and buys 2 more. How many apples does he have?\n",
           "answer": "3 + 2 = 5\n#### 5"}


class FakeTokenizer:
  """ChatML-like template; one id per character."""

  def __init__(self):
    self.calls = []

  def apply_chat_template(self, messages, add_generation_prompt=True):
    self.calls.append(add_generation_prompt)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_default_messages_ask_for_boxed():
  task = get_task(None)
  assert task.prompt_messages(EXAMPLE) == [{
      "role": "user",
      "content": "Tom has 3 apples and buys 2 more. How many apples does he have?\n" + DEFAULT_INSTRUCTION}]
  assert "\\boxed{}" in DEFAULT_INSTRUCTION
  assert config_lib.base_config().task.instruction == DEFAULT_INSTRUCTION


def test_chat_template_with_generation_prompt():
  tok = FakeTokenizer()
  task = get_task({"system_prompt": "You are a careful math tutor."})
  text = task.prompt_text(EXAMPLE, tok)
  assert text == ("<|im_start|>system\nYou are a careful math tutor.<|im_end|>\n"
                  "<|im_start|>user\nTom has 3 apples and buys 2 more. How many apples does he have?\n"
                  f"{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
  assert tok.calls == [True]
  ids = task.prompt_ids(EXAMPLE, tok)
  assert isinstance(ids, list) and tok.decode(ids) == text


def test_custom_instruction_and_plain_text():
  task = get_task({"instruction": "End with '#### <number>'.", "use_chat_template": False,
                   "system_prompt": "Solve it."})
  text = task.prompt_text(EXAMPLE)  # no tokenizer needed without the template
  assert text == ("Solve it.\n\nTom has 3 apples and buys 2 more. How many apples does he have?\n"
                  "End with '#### <number>'.\n")
  assert get_task({"instruction": ""}).prompt_messages(EXAMPLE)[0]["content"].endswith("have?")


def test_tokenizer_errors_are_clear():
  task = get_task(None)
  with pytest.raises(ValueError, match="use_chat_template=False"):
    task.prompt_text(EXAMPLE, tokenizer=None)

  class IdsTemplate(FakeTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True):
      return [1, 2, 3]

  with pytest.raises(TypeError, match="must return the prompt text"):
    task.prompt_text(EXAMPLE, IdsTemplate())
  with pytest.raises(ValueError, match="non-empty question"):
    PromptFormat().messages("   ")


def test_config_tree_and_errors():
  cfg = config_lib.base_config()
  cfg.task.name = "arithmetic"
  cfg.task.num_train = 20
  cfg.task.num_test = 5
  task = get_task(cfg.task)
  assert task.name == "arithmetic" and len(task.examples("train")) == 20
  assert task_settings(cfg.task)["num_test"] == 5
  with pytest.raises(KeyError, match="unknown task config keys \\['instructions'\\]"):
    get_task({"instructions": "x"})
  with pytest.raises(ValueError, match="task.name='math' is not one of"):
    get_task({"name": "math"})
  with pytest.raises(ValueError, match="unknown split"):
    task.examples("validation")


def test_thinking_off_reaches_the_chat_template():
  """``task.enable_thinking=False`` renders Qwen3's empty think block; other templates ignore it."""
  from areal_jax.models import byte_tokenizer
  qwen3_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and enable_thinking is false %}"
                "<think>\n\n</think>\n\n{% endif %}{% endif %}")
  tok = byte_tokenizer()
  tok.chat_template = qwen3_like
  off = get_task({"enable_thinking": False}).prompt_text(EXAMPLE, tok)
  on = get_task(None).prompt_text(EXAMPLE, tok)
  assert off == on + "<think>\n\n</think>\n\n"
  tok.chat_template = qwen3_like.replace("enable_thinking", "other_flag")
  assert get_task({"enable_thinking": False}).prompt_text(EXAMPLE, tok) == on
