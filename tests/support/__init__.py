"""Support modules for the tests (helpers, listeners, the crash harness, fault injection,
subprocess scripts), imported as ``support.<module>``: pytest puts tests/ on ``sys.path``
(``pythonpath`` in pyproject.toml); subprocesses get tests/ on ``PYTHONPATH``."""
