"""Environments an episode acts in, and the sandbox that runs the model's programs.

An environment follows one small interface: ``reset(example) -> observation``, ``step(action) ->
(observation, reward, done, info)``, ``close()``. ``PythonEnv`` (``python_env.py``) runs the
Python blocks of the model's text in a ``Sandbox`` (``python_sandbox.py``). Environments know
nothing of the runtime.
"""
