"""Tokenizer: the byte-level tiny tokenizer, chat templates, HF directory round trips."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from areal_jax.models.tokenizer import BYTE_SPECIALS, TemplateError, Tokenizer, byte_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks"}]


@pytest.fixture(scope="module")
def tok():
  return byte_tokenizer()


def test_byte_tokenizer_ids_are_bytes_then_specials(tok):
  assert tok.vocab_size == 259
  assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [256, 257, 258]
  assert tok.eos_token_ids == (258, 256) and tok.pad_token_id == 256 and tok.bos_token_id is None
  text = "héllo\n\t 1 2"
  assert tok.encode(text) == list(text.encode("utf-8"))
  assert tok.encode("a<|im_end|>b") == [97, 258, 98]
  assert tok.decode([97, 258, 98]) == "ab"
  assert tok.decode([97, 258, 98], skip_special_tokens=False) == "a<|im_end|>b"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_byte_tokenizer_round_trips_any_text(text):
  tok = byte_tokenizer()
  ids = tok.encode(text)
  if not any(s in text for s in BYTE_SPECIALS):  # Hypothesis also draws the source's literals
    assert len(ids) == len(text.encode("utf-8"))
  assert tok.decode(ids, skip_special_tokens=False) == text


def test_chatml_template(tok):
  text = tok.apply_chat_template(CHAT[:2])
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                  "<|im_start|>assistant\n")
  assert not tok.apply_chat_template(CHAT[:2], add_generation_prompt=False).endswith("assistant\n")


def test_template_helpers_match_hf_conventions():
  template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('no tools') }}{% endif %}{{ m | tojson }}\n{% endfor %}"
              "{{ eos_token }}")
  tok = Tokenizer(byte_tokenizer().backend, chat_template=template, bos_token="<|im_start|>",
                  eos_token="<|im_end|>")
  assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
      '<|im_start|>{"role": "user", "content": "é"}\n<|im_end|>')
  with pytest.raises(TemplateError, match="no tools"):
    tok.apply_chat_template([{"role": "tool", "content": ""}])
  with pytest.raises(ValueError, match="no chat template"):
    Tokenizer(byte_tokenizer().backend).apply_chat_template(CHAT)


def test_save_and_load_directory(tok, tmp_path):
  tok.save(tmp_path)
  back = Tokenizer.from_dir(tmp_path)
  assert back.eos_token_ids == tok.eos_token_ids and back.pad_token_id == tok.pad_token_id
  assert back.chat_template == tok.chat_template and back.vocab_size == tok.vocab_size
  assert back.encode("x<|im_start|>y") == tok.encode("x<|im_start|>y")


def test_from_dir_reads_inline_and_named_templates_and_generation_config(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  config = {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>",
            "chat_template": [{"name": "tool_use", "template": "T"},
                              {"name": "default", "template": "D"}]}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 258]}))
  loaded = Tokenizer.from_dir(tmp_path)
  assert loaded.chat_template == "D"
  assert loaded.eos_token_ids == (256, 258) and loaded.pad_token_id == 256
  config["chat_template"] = "inline"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert Tokenizer.from_dir(tmp_path).chat_template == "inline"
  (tmp_path / "chat_template.jinja").write_text("from file")  # transformers 5 layout wins
  assert Tokenizer.from_dir(tmp_path).chat_template == "from file"


def test_from_dir_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)


def test_transformers_reads_saved_directory(tok, tmp_path):
  transformers = pytest.importorskip("transformers")
  tok.save(tmp_path)
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for text in ["plain", "ünï 😀\n", "<|im_start|>user\nhi<|im_end|>\n"]:
    assert theirs.encode(text, add_special_tokens=False) == tok.encode(text)
  assert theirs.eos_token_id == tok.eos_token_ids[0]
  assert theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == (
      tok.apply_chat_template(CHAT))
