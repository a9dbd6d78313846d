"""A simulated vLLM OpenAI server: the fake replica under every gateway test and benchmark.

Entry points: ``tokenlane sim`` / ``python -m loadtest.sim`` (:mod:`.cli`), the in-process
:func:`.server.run_sim` for tests, and :class:`.supervisor.Supervisor` for a fleet of sim
processes. ``loadtest/sim/README.md`` lists every setting, its default and the default's source.
"""
