"""The sampler's decode kernels, per platform, and the one place that picks among them (``choice``).

  * ``attention.decode_attention``: what the model calls for a decode step's attention; runs the
    form ``choice.attention`` picked (C++ on CPU, dense XLA or Pallas on GPU, dense XLA on TPU).
  * ``cpu_attention``, ``cpu_matmul`` (+ ``.cc``, built through ``cpu_ffi``): the CPU C++ kernels.
  * ``xla_attention``, ``pallas_attention``: the XLA and Pallas forms.

Knows nothing of models, sampling or training.
"""
