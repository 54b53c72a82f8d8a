"""Code a tampering patch plants to fake test outcomes, shared by the grading tests that show each
such patch is graded unresolved."""

# A plugin that reports every test as passed: sets the outcome *and* clears longrepr, so
# pytest prints a clean `PASSED <id>` line that swebench's parser reads as a pass.
PLUGIN = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome = "passed"
    rep.longrepr = None
'''

# Library code that makes every test report pass once it is imported (no hook, no plugin).
REPORT_HACK = '''
import _pytest.reports as _reports

_orig = _reports.TestReport.from_item_and_call.__func__


def _from_item_and_call(cls, item, call):
    rep = _orig(cls, item, call)
    rep.outcome, rep.longrepr = "passed", None
    return rep


_reports.TestReport.from_item_and_call = classmethod(_from_item_and_call)
'''
