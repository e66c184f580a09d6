"""Every ``>>>`` example in ``retune/`` runs and prints what its docstring says (doctest, one test per module).

The examples are documentation users copy; a stale one is worse than none. Modules that need an
optional library skip when it is missing (``retune.integrations.flash`` needs lightning-flash).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import retune

SKIP = {"retune.__main__"}  # running it is the CLI
OPTIONAL = {"retune.integrations.flash": "flash"}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULE_NAMES = sorted(m.name for m in pkgutil.walk_packages(retune.__path__, "retune.") if m.name not in SKIP)


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_examples_run(name: str) -> None:
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in tests:
        result = runner.run(test, out=report.append)
        assert result.failed == 0, f"{test.name}: {result.failed} example(s) failed\n" + "".join(report)


def test_a_wrong_example_fails() -> None:
    """The runner above does fail on a wrong example."""
    parser = doctest.DocTestParser()
    test = parser.get_doctest(">>> 1 + 1\n3\n", {}, "planted", None, 0)
    assert doctest.DocTestRunner(optionflags=FLAGS).run(test, out=lambda _: None).failed == 1
