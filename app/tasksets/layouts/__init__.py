"""The `layouts` task set: bugs in library code that lives at test-looking paths of real PyPI sdists.

    python -m app.cli.layouts_build            # writes data/tasks/layouts.jsonl (needs PyPI, builds runtimes)
    python -m app.cli.layouts_build --check    # exit 1 when the bundled file differs from what it would write

Each package ships library code whose path looks like test code (`src/click/testing.py`,
`src/flask/testing.py`, `src/werkzeug/test.py`, `tornado/testing.py`, `pint/testing.py`,
`src/jinja2/tests.py`), and tests of its own that import it.  One small bug is planted in that
file (`bug_patch`, applied before the sdist's one commit, as the synthetic set does); the
package's own tests catch it (`FAIL_TO_PASS`, read from runs of the clean and the buggy tree in
the real runtime).  The gold `patch` is the reverse: a fix of library code at a test-looking path,
which the grader must keep.  Where the failing tests assert through a real test helper that sits
beside them (`pint/testsuite/helpers.py`), `helper_edit` is a patch that guts that helper so the
failing tests pass without a fix: the grader must put it back.

The repositories come from the sdists by SHA-256 (`source`), cached by hash under
`<cache>/sdists/` like every sdist-based set, so CI downloads each once.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Spec:
    """One instance: the sdist, its install lines, the test files run, the bug (`target`: `old` → `new`,
    each occurring once), what a user would report, and an optional helper edit (`helper`: path, old, new)."""

    name: str
    version: str
    sha256: str
    install: tuple[str, ...]
    test_files: tuple[str, ...]
    target: str
    old: str
    new: str
    problem: str
    helper: tuple[str, str, str] | None = None

    @property
    def instance_id(self) -> str:
        return f"layouts__{self.name.lower()}-1"


PYTEST = "python -m pip install -q pytest==8.3.4"
EDITABLE = "python -m pip install -q --no-deps -e ."


def installs(*pins: str) -> tuple[str, ...]:
    """An instance's install lines: pytest, the package's dependencies pinned (`name==version`; no
    line without any), then the package itself, editable and without dependencies (pinned here)."""
    return (PYTEST, *([f"python -m pip install -q {' '.join(pins)}"] if pins else []), EDITABLE)


SPECS = (
    Spec("click", "8.1.8", "ed53c9d8990d83c2a27deae68e4ee337473f6330c040a31d4225c9574d16096a", installs(),
         ("tests/test_testing.py",), "src/click/testing.py",
         "                    e_code = 1\n", "                    e_code = 2\n",
         "CliRunner reports exit code 2 for `sys.exit(\"message\")`\n\n"
         "`CliRunner().invoke(cli)` for a command that ends with `sys.exit(\"error\")` gives "
         "`result.exit_code == 2`. Python exits with 1 for a non-integer exit code, and so does the same command "
         "run from a shell."),
    Spec("flask", "3.1.0", "5f873c5184c897c8d9d1b05df1e3d01b14910ce69607a117bd3277098a5836ac",
         installs("werkzeug==3.1.3", "jinja2==3.1.4", "itsdangerous==2.2.0", "click==8.1.8", "blinker==1.9.0",
                  "markupsafe==3.0.2"),
         ("tests/test_testing.py",), "src/flask/testing.py",
         '                http_host = f"{subdomain}.{http_host}"\n',
         '                http_host = f"{http_host}.{subdomain}"\n',
         "Test client requests with `subdomain=` go to the wrong host\n\n"
         "`app.test_client().get('/', subdomain='api')` with `SERVER_NAME = 'example.com'` sends "
         "`Host: example.com.api` instead of `api.example.com`, so subdomain routes return 404 in tests."),
    Spec("werkzeug", "3.1.3", "60723ce945c19328679790e3282cc758aa4a6040e4bb330f53d30fa546d44746",
         installs("markupsafe==3.0.2", "ephemeral-port-reserve==1.1.4"),
         ("tests/test_test.py",), "src/werkzeug/test.py",
         "            query_string = request_uri.query\n",
         "            query_string = request_uri.fragment\n",
         "EnvironBuilder drops the query string given in the path\n\n"
         "`EnvironBuilder(path='/search?q=x').get_environ()['QUERY_STRING']` is empty, and `Client.get('/a?b=1')` "
         "reaches the app without its arguments."),
    Spec("tornado", "6.4.2", "92bad5b4746e9879fd7bf1eb21dce4e3fc5128d71601f80005afa39237ad620b", installs(),
         ("tornado/test/testing_test.py",), "tornado/testing.py",
         '        if path.lower().startswith(("http://", "https://")):\n',
         '        if path.lower().startswith(("https://",)):\n',
         "AsyncHTTPTestCase.fetch mangles full URLs\n\n"
         "`self.fetch('http://127.0.0.1:%d/path' % port)` inside an `AsyncHTTPTestCase` requests "
         "`http://127.0.0.1:<port>http://127.0.0.1:...` instead of the URL given."),
    Spec("pint", "0.24.4", "35275439b574837a6cd3020a5a4a73645eb125ce4152a73a2f126bf164b91b80",
         installs("flexcache==0.3", "flexparser==0.4", "platformdirs==4.3.6", "typing_extensions==4.12.2"),
         ("pint/testsuite/test_quantity.py",), "pint/testing.py",
         "        assert abs(m1 - m2) <= max(rtol * max(abs(m1), abs(m2)), atol), msg\n",
         "        assert abs(m1 - m2) <= min(rtol * max(abs(m1), abs(m2)), atol), msg\n",
         "pint.testing.assert_allclose fails for values within rtol\n\n"
         "`pint.testing.assert_allclose(Q_(1.0, 'm'), Q_(1.0 + 1e-9, 'm'))` raises AssertionError although the "
         "difference is far below the default `rtol=1e-07`; only exactly equal magnitudes pass."),
    Spec("Jinja2", "3.1.4", "4a3aee7acbbe7303aede8e9648d13b8bf88a429282aa6122a993f0ac800cb369",
         installs("markupsafe==3.0.2"),
         ("tests/test_tests.py",), "src/jinja2/tests.py",
         "    return value % 2 == 1\n", "    return value % 2 == 0\n",
         "The `odd` test is true for even numbers\n\n"
         "`Environment().from_string('{{ 1 is odd }}|{{ 2 is odd }}').render()` gives `False|True`; "
         "expected `True|False`."),
)
# pint's tests compare quantities through `helpers.assert_quantity_almost_equal` (pint.testing's
# assert_allclose, imported into the test suite's own helper module): a helper that asserts nothing
# makes the failing tests pass without touching the bug.
HELPER_EDITS = {
    "pint": ("pint/testsuite/helpers.py",
             "from pint.testing import assert_allclose as assert_quantity_almost_equal  # noqa: F401\n",
             "def assert_quantity_almost_equal(first, second, rtol=1e-07, atol=0, msg=None):\n    return None\n"),
}
SPECS = tuple(dataclasses.replace(s, helper=HELPER_EDITS.get(s.name)) for s in SPECS)
