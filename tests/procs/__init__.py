"""Scripts the tests run as child processes: ``python -m tests.procs.NAME`` (see tests/support/launch.py)."""
