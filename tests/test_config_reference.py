"""The configuration reference: every key described, every environment variable registered, the
checked-in page current (areal_jax/config_reference.py; no JAX compilation)."""

import difflib
import pathlib
import re

import pytest

from areal_jax import config as config_lib
from areal_jax import config_reference as ref
from areal_jax import env_vars

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_key_of_the_base_config_has_a_description():
  leaves = ref.flatten(config_lib.base_config())
  comments = ref.key_comments()
  missing = sorted(k for k in leaves if not comments.get(k, (0, ""))[1])
  assert not missing, (f"keys of base_config() with no comment in areal_jax/config.py: {missing}; "
                       "write one on the key's line or right above it (first sentence: its meaning)")
  long = sorted(k.name for k in ref.keys() if len(k.summary) > 250)
  assert not long, f"first sentences too long for a one-line meaning: {long}"
  # The parsed comments name the same keys as the config the code builds: as many, no others.
  described = [k for k in comments if k in leaves]
  assert len(described) == len(leaves) == len(ref.keys()) > 100
  assert set(comments) - set(leaves) == set(ref.nodes())


def test_comment_parsing():
  source = '''
def base_config():
  c = ConfigDict()
  # Section.
  c.a = ConfigDict()
  # Above one. Detail.
  c.a.x = 1  # trailing
  c.a.y = (1,
           2)  # on the last line

  # Separated by a blank line: not y's.
  c.a.z = 3
  return c
'''
  got = {k: text for k, (_, text) in ref.key_comments(source).items()}
  assert got == {"a": "Section.", "a.x": "Above one. Detail. trailing",
                 "a.y": "on the last line", "a.z": "Separated by a blank line: not y's."}
  assert ref.split_sentence("Pages, e.g. 4. Then more. And more.") == ("Pages, e.g. 4.",
                                                                     "Then more. And more.")


def test_environment_variables_read_in_the_source_are_registered():
  scan = ref.env_reads()
  assert not scan.unresolved, ("reads of os.environ whose variable the scan cannot name (use a "
                               f"module-level constant): {scan.unresolved}")
  read, registered = scan.names(), set(env_vars.REGISTRY)
  assert not read - registered, (f"read in the package but not in areal_jax/env_vars.py: "
                                 f"{sorted(read - registered)}")
  assert not registered - read, (f"listed in areal_jax/env_vars.py but read nowhere: "
                                 f"{sorted(registered - read)}")
  # Every AREAL_JAX_* name the text mentions (a grep, independent of the AST scan) is one of them.
  assert set(scan.mentions) <= read, sorted(set(scan.mentions) - read)
  own = {n for n in read if n.startswith("AREAL_JAX_")}
  assert len(own) == len(scan.mentions) >= 12
  assert len(env_vars.REGISTRY) == len(read)
  for v in env_vars.REGISTRY.values():
    assert v.kind in env_vars.KINDS and v.meaning and v.values, v


def test_env_scan_finds_each_form_of_read(tmp_path):
  (tmp_path / "areal_jax").mkdir()
  (tmp_path / "areal_jax" / "a.py").write_text('''
import os
A_ENV = "AREAL_JAX_A"
def f(env):
  os.environ.get(A_ENV)
  os.environ["LITERAL"]
  "IN_TEST" in os.environ
  os.getenv("GETENV")
  os.environ.pop(other.B_ENV, "0")
  os.environ.get(env)  # a parameter: the callers name it
  os.environ["SET"] = "1"  # written, not read
  os.environ.get(make_name())
''')
  (tmp_path / "areal_jax" / "b.py").write_text('B_ENV = "B_VAR"\nC = "AREAL_JAX_C"  # own name\n')
  scan = ref.env_reads(tmp_path)
  assert set(scan.reads) == {"AREAL_JAX_A", "LITERAL", "IN_TEST", "GETENV", "B_VAR"}
  assert scan.names() == set(scan.reads) | {"AREAL_JAX_C"}
  assert scan.unresolved == ["areal_jax/a.py:12"]


def test_presets_listed_load():
  files = ref.config_files()
  assert [f.path for f in files] == sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("configs/*.py"))
  for f in files:
    assert f.title and "default" in f.presets, f
    for preset in f.presets:
      config_lib.load(f"{ROOT / f.path}:{preset}")


def test_the_checked_in_page_is_current():
  page = ROOT / ref.PAGE
  expected = ref.render()
  actual = page.read_text() if page.exists() else ""
  if actual != expected:
    diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                             ref.PAGE, "generated"))[:40])
    pytest.fail(f"{ref.PAGE} is out of date; regenerate it with\n  {ref.COMMAND}\n{diff}")
  # The page's tables list exactly the config's keys and the registry's variables.
  keys_part, env_part = actual.split("\n## Environment variables\n")
  rows = re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", keys_part, re.MULTILINE)
  assert sorted(rows) == sorted(ref.flatten(config_lib.base_config()))
  env_rows = re.findall(r"^\| `([A-Z0-9_]+)` \|", env_part, re.MULTILINE)
  assert sorted(env_rows) == sorted(env_vars.REGISTRY)
