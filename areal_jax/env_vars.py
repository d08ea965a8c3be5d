"""Every environment variable the package reads, with what it does.

Configuration belongs in the config tree (``areal_jax/config.py``); environment variables are
kept for three narrower uses:

* kernel overrides: they force one kernel or launch setting process-wide where the config leaves
  the choice to the platform (``"auto"``), and reach the engines that benchmarks and tests build
  without a config (``bench/``, ``tests/kernels/``). Set them before the process builds its engines;
* variables the package sets for its own child processes (not meant to be set by hand);
* other programs' variables that the package also reads (JAX's, the compiler's, OpenAI's client).

``REGISTRY`` is what the configuration reference lists (``python -m areal_jax.config_reference``);
``tests/test_config_reference.py`` scans the source and fails when a variable read there is missing
here, or when one listed here is no longer read.
"""

from __future__ import annotations

import dataclasses

OVERRIDE = "kernel override"
INTERNAL = "set by the package"
EXTERNAL = "other programs'"
KINDS = (OVERRIDE, INTERNAL, EXTERNAL)


@dataclasses.dataclass(frozen=True)
class EnvVar:
  name: str
  kind: str  # one of KINDS
  values: str  # what it accepts, briefly
  meaning: str  # first sentence: the one-line meaning; any further sentences: detail


_VARS = (
    # Kernel overrides (areal_jax/kernels/): each applies where the config says "auto".
    EnvVar("AREAL_JAX_DECODE_ATTENTION", OVERRIDE, "cpu, xla, dense, pallas_gpu, pallas_tpu",
           "The decode attention kernel where rollout.decode_attention is \"auto\". "
           "Benchmarks compare kernels with it in engines they build without a config."),
    EnvVar("AREAL_JAX_DECODE_MATMUL", OVERRIDE, "cpu_packed, xla, blas",
           "The decode step's matmuls where rollout.decode_matmul is \"auto\". "
           "A value set here is also kept by the GPU launch tuning (rollout.decode_tuning)."),
    EnvVar("AREAL_JAX_DECODE_LAYERS", OVERRIDE, "scan, unrolled",
           "How the decode step runs the layers where rollout.decode_layers is \"auto\"."),
    EnvVar("AREAL_JAX_DECODE_PROJECTIONS", OVERRIDE, "fused, separate",
           "The decode step's q/k/v and gate/up projections where rollout.decode_projections is "
           "\"auto\"."),
    EnvVar("AREAL_JAX_CAUSAL_ATTENTION", OVERRIDE, "dense, pallas_gpu, pallas_tpu",
           "The causal attention of prefills and of the train step where rollout.prefill_attention "
           "or actor.attention is \"auto\". One variable for both keys."),
    EnvVar("AREAL_JAX_PAGED_CACHE", OVERRIDE, "1, 0",
           "Forces the paged KV cache on (1) or off (0) where rollout.kv_pages is -1 (per platform). "
           "Tests use it to run the GPU's paged choice on CPU."),
    EnvVar("AREAL_JAX_PALLAS_GPU_PAGED", OVERRIDE,
           "fields, e.g. block_pages=2,parts=4,warps=4,stages=3,bound=1,writes=1,dot=1",
           "Launch settings of the Pallas GPU paged-attention kernel. "
           "A launch set here is kept by the GPU launch tuning instead of being timed."),
    EnvVar("AREAL_JAX_PALLAS_GPU_BLOCK_PAGES", OVERRIDE, "a positive integer",
           "Pages per block of the Pallas GPU paged-attention kernel, alone of its launch settings."),
    EnvVar("AREAL_JAX_DECODE_NORM_MATMUL", OVERRIDE, "1, 0, or fields, e.g. block_n=32,warps=8,stages=3",
           "Runs each RMSNorm of a GPU decode step in one Pallas kernel with the matmul after it. "
           "Off by default (0 or unset), where the engine's launch tuning may still choose it."),
    EnvVar("AREAL_JAX_DECODE_QUERY_ROWS", OVERRIDE, "a positive integer (1: no padding)",
           "The multiple the dense decode attention pads each K/V head's group of queries to. "
           "By default 8 for a 16-bit cache with library GEMMs (rollout.decode_matmul \"blas\"), "
           "else 1."),
    EnvVar("AREAL_JAX_HELD_LAYOUTS", OVERRIDE, "compiler, default",
           "Whether the sampler holds its weights and decode state in the layouts the compiler "
           "picks or in the default ones. By default the compiler's on TPU, the default ones "
           "elsewhere; tests force \"compiler\" on CPU."),
    EnvVar("AREAL_JAX_TRUNCATION_ON_HOST", OVERRIDE, "1, 0",
           "Whether top-k / top-p truncation is decided on the host, which picks a decode program "
           "with or without the vocabulary's sort. By default on GPU only."),
    EnvVar("AREAL_JAX_CPU_KERNELS", OVERRIDE, "0 (off), 1 (default)",
           "0 turns off the package's C++ CPU kernels (attention and packed matmuls); XLA's "
           "forms run instead."),
    # Set by the package for its own child processes.
    EnvVar("AREAL_JAX_LEARNER_AUTHKEY", INTERNAL, "hex string",
           "The key learner processes use to connect to the driver (runtime.learner_processes > 1). "
           "Set by the driver for the processes it starts; learner processes started by a "
           "cluster's launcher need the driver's key."),
    EnvVar("AREAL_JAX_SUPERVISED", INTERNAL, "1",
           "Marks the training process that the supervisor started, so it does not supervise "
           "itself."),
    EnvVar("AREAL_LIFELINE_PID", INTERNAL, "a process id",
           "The vLLM lifeline's process id, read by the command it guards to stop when the "
           "lifeline is gone."),
    # Other programs' variables the package reads.
    EnvVar("XLA_FLAGS", EXTERNAL, "XLA's flags",
           "XLA's flags, which the package extends rather than replaces. "
           "launch.py, evaluate and export default to 8 host devices when it is unset "
           "(--xla_force_host_platform_device_count=8); CPU rollout workers and learner processes "
           "get their own device count in it; with command-buffer flags set here, the GPU launch "
           "tuning does not time CUDA graphs."),
    EnvVar("JAX_COMPILATION_CACHE_DIR", EXTERNAL, "a directory",
           "JAX's persistent compilation cache; when set it wins over runtime.compile_cache_dir "
           "(launch.py)."),
    EnvVar("PYTHONPATH", EXTERNAL, "paths",
           "Passed on to Ray rollout workers, with this checkout's root first."),
    EnvVar("CUDA_VISIBLE_DEVICES", EXTERNAL, "GPU indices or UUIDs",
           "The first GPU listed is the one whose free memory sizes vLLM's share "
           "(rollout.vllm.gpu_memory_utilization = 0)."),
    EnvVar("OPENAI_API_KEY", EXTERNAL, "a key",
           "The API key the model judge sends to serve.judge_url (\"none\" when unset) and the "
           "OPD teacher to serve.teacher_url (none when unset)."),
    EnvVar("CXX", EXTERNAL, "a C++ compiler (default g++)",
           "The compiler that builds the C++ CPU kernels."),
    EnvVar("XDG_CACHE_HOME", EXTERNAL, "a directory (default ~/.cache)",
           "Where the built C++ CPU kernels are cached (under areal_jax/)."),
)

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}
