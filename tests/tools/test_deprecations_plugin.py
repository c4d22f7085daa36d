"""tests/support/deprecations.py: asymcheck's and asymstore's DeprecationWarnings fail a test; others do not."""

from __future__ import annotations

import warnings

import pytest

import asymcheck
from asymcheck.options import resolve
from tests.support.deprecations import ROOT, Raiser, issuer


def test_a_deprecation_asymcheck_issues_is_raised_where_the_test_called_it() -> None:
    with pytest.raises(DeprecationWarning, match="keep_last"):
        resolve({}, {"keep_last": 5})  # attributed to this test (stacklevel), issued by asymcheck.options
    with pytest.raises(DeprecationWarning, match=r"asymcheck\.Planner is deprecated"):
        asymcheck.Planner  # noqa: B018  (the module __getattr__ of a moved name)


def test_it_is_raised_under_an_always_filter_too() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with pytest.raises(DeprecationWarning, match="keep_last"):
            resolve({}, {"keep_last": 5})


def test_the_deprecated_path_on_purpose_is_recorded_not_raised() -> None:
    with pytest.deprecated_call(match="retention=RetentionOptions"):
        options = resolve({}, {"keep_last": 5})
    assert options.retention.keep_last == 5


def test_an_ignore_filter_still_ignores_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resolve({}, {"keep_last": 7}).retention.keep_last == 7


def test_other_deprecations_and_other_warnings_stay_warnings() -> None:
    with pytest.warns(DeprecationWarning, match="not ours"):  # recorded: the plugin is not asked
        warnings.warn("not ours", DeprecationWarning, stacklevel=1)
    raiser, shown = Raiser(), []
    raiser.previous = lambda message, *rest: shown.append(message)
    own = DeprecationWarning("this test's own deprecation")
    raiser.show(own, DeprecationWarning, __file__, 1)  # issued by this module: shown
    user = UserWarning("a user warning")
    raiser.show(user, UserWarning, str(ROOT / "asymcheck" / "checkpointer.py"), 1)
    assert shown == [own, user]


def test_issuer_skips_the_warnings_module() -> None:
    import sys

    assert issuer(sys._getframe()) == __name__
