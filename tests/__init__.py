"""The test suite of asymstore and asymcheck, grouped by area (tests/<area>/); see tests/conftest.py."""
