"""colabs/quickstart.ipynb runs top to bottom in a fresh kernel, as on a one-device Colab runtime."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "colabs" / "quickstart.ipynb"


def outputs(nb, kind):
  return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
          if o.get("output_type") == kind]


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")

  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel inherits this environment: one CPU device (the colocated Colab set-up), and the
  # checkout importable without an install, so the install cell is skipped.
  monkeypatch.setenv("XLA_FLAGS", " ".join(  # (the tests' other compile flags kept)
      [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
      + ["--xla_force_host_platform_device_count=1"]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure

  text = "".join(o.get("text", "") for o in outputs(nb, "stream"))
  assert "configs from" in text and "git clone" not in text
  assert "step 4/4" in text  # trainer.run's progress lines
  assert "curves: " in text and "greedy pass@1 =" in text
  assert "'eval_accuracy'" in text  # the last step evaluated (train.eval_every=2)
  # the LoRA section: a 2-step adapter run, exported as a PEFT dir and as merged weights
  assert "step 2/2" in text
  assert "adapter: ['adapter_config.json', 'adapter_model.safetensors']" in text
  assert "merged: [" in text and "'r': 8" in text
  images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
  assert images, "the curves cell displayed no PNG"


def test_install_cell_installs_the_clone_as_a_path_with_the_chosen_plugin(tmp_path, monkeypatch):
  """Where areal_jax is not importable (Colab), the install cell clones the repository and pip
  installs that directory, with JAX's plugin extra when one is chosen. pip reads an argument
  without a path separator as a package name to look up in its index, not as the directory."""
  nbformat = pytest.importorskip("nbformat")
  interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
  cell = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
              if c.cell_type == "code" and "%pip install" in c.source)
  shell = interactiveshell.InteractiveShell.instance()
  ran = []  # the shell commands and magics, their {expressions} expanded as IPython does
  monkeypatch.setattr(shell, "system", lambda cmd: ran.append(shell.var_expand(cmd)))
  monkeypatch.setattr(shell, "run_line_magic",
                      lambda name, line, *a, **k: ran.append(f"%{name} {shell.var_expand(line)}"))
  monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
  monkeypatch.chdir(tmp_path)
  for extra, suffix in (("tpu", "[tpu]"), ("cuda12", "[cuda12]"), ("", "")):
    ran.clear()
    source = cell.replace("JAX_EXTRA = None ", f"JAX_EXTRA = {extra!r} ")
    assert source != cell
    assert shell.run_cell(source).success
    clone, install = ran
    assert clone.startswith("git clone") and clone.endswith(" areal_jax_repo")
    target = install.split()[-1].strip('"')
    assert install.startswith("%pip install") and target == f"./areal_jax_repo{suffix}"
  shell.clear_instance()
