"""Platform kernels (the sampler's decode, whole rows' attention) and the one place that picks among
them (``choice``).

  * ``attention.decode_attention``: what the model calls for a decode step's attention; runs the
    form ``choice.attention`` picked (C++ on CPU, dense XLA or Pallas on GPU, dense XLA on TPU).
  * ``cpu_attention``, ``cpu_matmul`` (+ ``.cc``, built through ``cpu_ffi``): the CPU C++ kernels.
  * ``xla_attention``, ``pallas_attention``: the XLA and Pallas forms.
  * ``causal_attention``: whole rows' causal attention (a training step's, a prefill's) as the
    flash kernels JAX ships for GPU and TPU (``choice.causal_attention`` picks it or the model's
    dense form).

Knows nothing of models, sampling or training.
"""
