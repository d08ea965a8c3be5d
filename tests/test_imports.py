"""Every module of areal_jax imports, in a fresh interpreter (so an import that works only after
another test imported something first still fails here). The fast suite (`make test-fast`) thereby
touches every module, including those whose tests are all slow."""

import json
import pathlib
import subprocess
import sys

import areal_jax

# Top-level packages of optional extras (pyproject.toml) that the main venv may lack: a module that
# fails only because one of these is missing is skipped, not failed. Today the main venv imports
# every module (vLLM's backend imports vllm only when it starts).
OPTIONAL = ("vllm", "torch")

_SCRIPT = r"""
import importlib, json, pkgutil, sys
from absl import flags
import areal_jax
results = {}
for info in pkgutil.walk_packages(areal_jax.__path__, "areal_jax."):
  before = set(flags.FLAGS)
  try:
    importlib.import_module(info.name)
    results[info.name] = None
  except ModuleNotFoundError as e:
    root = (e.name or "").split(".")[0]
    results[info.name] = ("missing " + root) if root in OPTIONAL else repr(e)
  except BaseException as e:
    results[info.name] = repr(e)
  for name in set(flags.FLAGS) - before:  # entry points define absl flags of the same names
    delattr(flags.FLAGS, name)
print(json.dumps(results))
"""


def test_every_module_of_areal_jax_imports():
  root = pathlib.Path(areal_jax.__file__).parent
  files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
           for p in root.rglob("*.py")}
  out = subprocess.run([sys.executable, "-c", f"OPTIONAL = {OPTIONAL!r}\n" + _SCRIPT],
                       capture_output=True, text=True, timeout=300, check=True)
  results = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(results) == files - {"areal_jax"}  # walk_packages found every file
  failed = {m: e for m, e in results.items() if e and not e.startswith("missing ")}
  assert not failed, failed
