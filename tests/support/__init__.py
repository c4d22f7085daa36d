"""Helpers the tests import (``from tests.support.x import ...``); child processes import them too."""
