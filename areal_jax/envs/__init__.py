"""Environments an episode acts in, and the sandbox that runs the model's programs.

An environment follows one small interface, awaitable (``base.py``): ``reset(example) ->
observation``, ``step(action) -> (observation, reward, done, info)``, ``close()``. It runs in
process (``base.InProcessEnvs``: blocking classes on threads of their own), in a pool of worker
processes on this host (``pool.py``, ``worker.py``) or of Ray actors (``ray_pool.py``), or behind
an HTTP server (``remote.py``, the reference server ``serve.py``); ``factory.py`` picks one from
``rollout.env``. Failures end the
episode with one of ``base.FAILURES``. Environments: ``PythonEnv`` (``python_env.py``) runs the
Python blocks of the model's text in a ``Sandbox`` (``python_sandbox.py``); ``CalculatorEnv``
(``calculator.py``); ``SyntheticEnv`` (``synthetic.py``, latency and faults on demand, for tests and
benchmarks). Environments know nothing of the runtime.
"""
