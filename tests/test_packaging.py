"""pyproject.toml's accelerator extras install JAX's plugins at the very JAX version the package pins
(a plugin of another version does not load, and JAX falls back to the CPU without failing), and the
quickstart notebook installs only extras that exist."""

import json
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ACCELERATOR_EXTRAS = ("cuda12", "cuda13", "tpu")


def pinned(requirements, name):
  """The version ``name`` is pinned to (``==``) in a list of requirement strings."""
  pins = [m.group(2) for r in requirements
          if (m := re.fullmatch(rf"{re.escape(name)}(\[[a-z0-9,]+\])?==([\w.]+)", r.replace(" ", "")))]
  assert len(pins) == 1, f"{name} is not pinned once with == in {requirements}"
  return pins[0]


def test_accelerator_extras_pin_the_packages_jax():
  jax_version = pinned(PROJECT["dependencies"], "jax")
  assert pinned(PROJECT["dependencies"], "jaxlib") == jax_version
  lock = (ROOT / "requirements.lock").read_text().splitlines()
  assert f"jax=={jax_version}" in lock and f"jaxlib=={jax_version}" in lock
  extras = PROJECT["optional-dependencies"]
  for extra in ACCELERATOR_EXTRAS:
    assert extras[extra] == [f"jax[{extra}]=={jax_version}"], extra


def test_notebook_installs_only_extras_the_project_defines():
  nb = json.loads((ROOT / "colabs" / "quickstart.ipynb").read_text())
  install = next("".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "code" and "%pip install" in "".join(c["source"]))
  named = set(re.findall(r'"(cuda\d+|tpu)"', install))
  assert named == set(ACCELERATOR_EXTRAS)
  assert named <= set(PROJECT["optional-dependencies"])
