"""launch/gpu_host.sh stops, before it starts Ray, when the JAX it would run has no GPU backend (JAX
would silently train on the CPU): the message names the GPUs attached and the install that fixes it."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_stops_before_ray_when_jax_sees_no_gpu(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  smi = bin_dir / "nvidia-smi"  # 4 GPUs attached, as nvidia-smi --list-gpus prints them
  smi.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
  smi.chmod(0o755)
  started = tmp_path / "ray-started"
  python_dir = tmp_path / "venv" / "bin"  # the script runs $(dirname $PYTHON)/ray: a fake that tells
  python_dir.mkdir(parents=True)
  (python_dir / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this venv's JAX
  (python_dir / "python").chmod(0o755)
  (python_dir / "ray").write_text(f"#!/bin/sh\ntouch {started}\n")
  (python_dir / "ray").chmod(0o755)
  env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
         "PYTHON": str(python_dir / "python"), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(["bash", str(ROOT / "launch" / "gpu_host.sh"), "configs/gsm8k.py:tiny",
                         str(tmp_path / "run"), "2", "1"], env=env, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 1, done
  assert "sees no GPU (4 attached)" in done.stderr and "make install ACCEL=cuda12" in done.stderr
  assert not started.exists() and not (tmp_path / "run").exists()
