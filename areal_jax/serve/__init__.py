"""Learning from serving: an OpenAI-compatible server whose conversations train the policy.

Modules: ``app`` (HTTP API), ``protocol`` (wire format), ``dispatch`` (engine <-> event loop),
``store`` (SQLite turn store), ``judge`` (judge loop), ``trainer_loop`` (trainer loop), ``runtime``
(the four loops together), ``simulated_user`` and ``demo`` (``make serve-demo``).
"""
