"""Runs inside the sandbox as a test job's main: pytest over a repository, one report line per test.

Job layout (envs/swe/testrun.py builds it): this file, `request.json`, the repository under `repo/`
and the dependency tree under `env/` (read-only, like every job file). The repository is copied
to /tmp/repo, a writable checkout as a test suite expects, and pytest runs there in this
process. Order matters, and is the point of this file:

1. `/work/job` leaves `sys.path` (its `repo`/`env` folders would be importable namespaces);
2. pytest and its plugins are imported from `env/` only, before the repository is on the path,
   so a `pytest.py`, `_pytest/` or `pluggy/` planted in the repository is never the runner;
3. entry-point autoloading is off; the plugins of `env/`'s own distributions are named with
   `-p`, which pytest resolves before the repository is on the path (the recorder puts it there
   when the first conftest.py is about to load), so a `*.dist-info` planted in the repository
   registers nothing;
4. the recorder is handed to `pytest.main` and so registered before any conftest.py is read;
5. the interpreter already ran `site` before the job existed (the sandbox starts `python -I`), and
   `env/` is a plain path, not a site dir: `.pth`, `sitecustomize` and `usercustomize` files
   in the repository or `env/` are never executed.

Report (fd 3): first `{"key": HEX}`, a fresh random key written before any repository code
exists in the process; then one line per record, `MAC JSON`, MAC being the record's HMAC-SHA256
under that key: `{"collected": n}`, one `{"t": node id, "o": outcome, "m": text}` per finished
test (`m`: a failure's trimmed text, only for failed/error), and at the end `{"end": pytest's
exit code, "tamper": null or why}`. A test that never finishes has no line. The key lives only
in this process's memory (a closure), so repository code that writes lines to fd 3 must first
find it there: a forged report takes introspection of the runner, not knowledge of its format.

The tamper check (the footer's `tamper`): after the run, the functions that make outcomes
(runner, report construction, the recorder's own hooks) must be the objects they were before
any repository code ran, and every implementation of an outcome-deciding hook must come from
`env/`, pytest itself, or a file the request names in `hook_files` (the trusted conftest.py
files). It catches code that patches the runner the obvious ways; it is not a wall: code in
this process can reach anything in it, this check included (testrun.py says what that means).
Not standalone-safe: run only inside the sandbox.
"""

import hashlib
import hmac
import json
import os
import shutil
import sys

JOB_DIR = "/work/job"
REPO_DIR = "/tmp/repo"
FD_REPORT = 3
MESSAGE_CHARS = 2000  # per failing test
MESSAGE_BUDGET_CHARS = 200_000  # over all tests: the report pipe holds 1 MiB
OUTCOME_HOOKS = (
    "pytest_runtest_protocol",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_runtest_call",
    "pytest_pyfunc_call",
    "pytest_runtestloop",
    "pytest_report_teststatus",
)

CRITICAL = {  # per _pytest module: functions and class attributes that decide a test's outcome
    "runner": ("runtestprotocol", "call_and_report", "call_runtest_hook", "check_interactive_exception",
               "CallInfo.from_call", "pytest_runtest_makereport", "pytest_runtest_protocol"),
    "reports": ("TestReport.from_item_and_call", "TestReport.__init__", "BaseReport.passed", "BaseReport.failed"),
    "python": ("pytest_pyfunc_call", "Function.runtest"),
    "main": ("pytest_runtestloop",),
}  # fmt: skip


def main():
    report = os.fdopen(FD_REPORT, "w", encoding="utf-8", errors="backslashreplace", buffering=1)
    emit = _signed_writer(report)
    with open(os.path.join(JOB_DIR, "request.json"), encoding="utf-8") as handle:
        request = json.load(handle)
    env_dir = os.path.join(JOB_DIR, "env")
    sys.path[:] = [p for p in sys.path if p not in (JOB_DIR, "")]
    if os.path.isdir(env_dir):
        sys.path.insert(0, env_dir)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest  # from env/ or the sandbox's /usr, never from the repository

    plugin_args = []
    for name in _env_plugins(env_dir):
        plugin_args += ["-p", name]
    shutil.copytree(os.path.join(JOB_DIR, "repo"), REPO_DIR, symlinks=True)
    os.chdir(REPO_DIR)
    wanted = request["test_ids"]
    python_path = [os.path.normpath(os.path.join(REPO_DIR, entry)) for entry in request["python_path"]]
    recorder = Recorder(emit, None if wanted is None else set(wanted), python_path)
    trusted_files = {os.path.join(REPO_DIR, path) for path in request["hook_files"]}
    guard = Guard(pytest, recorder, env_dir, trusted_files)
    args = ["-p", "no:cacheprovider", "-q", "--no-header", "-o", "console_output_style=classic",
            *plugin_args, *request["args"], *request["paths"]]  # fmt: skip
    code = pytest.main(args, plugins=[recorder, guard])
    tamper = guard.verdict(recorder)
    emit({"end": int(code), "tamper": tamper})
    report.flush()
    os._exit(0)


def _signed_writer(report):
    """Write the key line now; return the function that writes one signed record per line."""
    key = os.urandom(32)
    report.write(json.dumps({"key": key.hex()}) + "\n")
    report.flush()

    def emit(record):
        line = json.dumps(record)
        report.write(hmac.new(key, line.encode(), hashlib.sha256).hexdigest() + " " + line + "\n")

    return emit


def _env_plugins(env_dir):
    """Names of the pytest11 entry points of the distributions installed in `env_dir`."""
    if not os.path.isdir(env_dir):
        return []
    from importlib.metadata import distributions

    names = []
    for dist in distributions(path=[env_dir]):
        names += [ep.name for ep in dist.entry_points if ep.group == "pytest11"]
    return sorted(set(names))


class Recorder:
    """Per-test outcome from the phase reports; one report line when a test's teardown ends."""

    def __init__(self, emit, wanted, python_path):
        self._emit = emit
        self.wanted = wanted
        self.python_path = python_path

    def pytest_load_initial_conftests(self, early_config, parser, args):
        """The repository goes on the path now: `-p` plugins are resolved, and no conftest.py is
        read yet (pytest reads them in its own implementation of this hook, which runs last)."""
        sys.path[:0] = self.python_path  # as `python -m pytest` puts the cwd first
        self.pending = {}  # node id -> outcome so far
        self.messages = {}  # node id -> the failing phase's text
        self.budget = MESSAGE_BUDGET_CHARS

    def pytest_collection_modifyitems(self, session, config, items):
        if self.wanted is not None:
            kept = [item for item in items if item.nodeid in self.wanted]
            dropped = [item for item in items if item.nodeid not in self.wanted]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = kept

    def pytest_collection_finish(self, session):
        self._emit({"collected": len(session.items)})

    def pytest_collectreport(self, report):
        if report.failed:  # a module that does not import: its tests are errors
            self._emit({"t": report.nodeid, "o": "error", "m": self._message(report), "collect": True})

    def pytest_runtest_logreport(self, report):
        outcome = self.pending.get(report.nodeid)
        if report.when == "setup":
            outcome = "error" if report.failed else "skipped" if report.skipped else None
        elif report.when == "call":
            outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
        elif report.failed:  # teardown
            outcome = "error"
        if report.failed and report.nodeid not in self.messages:
            self.messages[report.nodeid] = self._message(report)
        self.pending[report.nodeid] = outcome
        if report.when == "teardown":
            final = self.pending.pop(report.nodeid) or "error"
            message = self.messages.pop(report.nodeid, "")
            line = {"t": report.nodeid, "o": final}
            if final in ("failed", "error") and message:
                line["m"] = message
            self._emit(line)

    def _message(self, report):
        text = getattr(report, "longreprtext", "") or ""
        take = min(MESSAGE_CHARS, self.budget)
        self.budget -= take
        return text[-take:] if take > 0 else ""


class Guard:
    """The tamper check (module docstring): identities taken before any repository code runs."""

    def __init__(self, pytest, recorder, env_dir, trusted_files):
        import _pytest.python
        import _pytest.reports
        import _pytest.runner

        self.config = None
        self.env_dir = env_dir
        self.trusted_files = trusted_files
        self.allowed_dirs = tuple(
            os.path.dirname(module.__file__) for module in (_pytest.runner, sys.modules["pluggy"])
        ) + ((env_dir + os.sep,) if os.path.isdir(env_dir) else ())
        self.objects = self._critical(recorder)
        self.expected = dict(self.objects)

    @staticmethod
    def _critical(recorder):
        """The objects that make outcomes; a name this pytest version lacks is None both times."""
        import _pytest.main
        import _pytest.python
        import _pytest.reports
        import _pytest.runner

        found = {"json.dumps": json.dumps, "os.write": os.write}
        for module in (_pytest.runner, _pytest.reports, _pytest.python, _pytest.main):
            short = module.__name__.rpartition(".")[2]
            for name in CRITICAL.get(short, ()):
                owner, _, attribute = name.rpartition(".")
                holder = getattr(module, owner, None) if owner else module
                found[f"{short}.{name}"] = vars(holder).get(attribute) if holder is not None else None
        for name in ("pytest_runtest_logreport", "pytest_collection_modifyitems"):
            found[f"recorder.{name}"] = vars(type(recorder))[name]
        found["recorder._emit"] = vars(recorder)["_emit"]
        return found

    def pytest_configure(self, config):
        self.config = config

    def verdict(self, recorder):
        for name, value in self._critical(recorder).items():
            if value is not self.expected[name]:
                return f"{name} was replaced"
        if self.config is None:
            return None
        for hook_name in OUTCOME_HOOKS:
            for impl in getattr(self.config.pluginmanager.hook, hook_name).get_hookimpls():
                if impl.plugin is recorder or impl.plugin is self:
                    continue
                path = os.path.realpath(getattr(impl.function, "__code__", None) and impl.function.__code__.co_filename
                                        or "?")  # fmt: skip
                if not (path.startswith(self.allowed_dirs) or path in self.trusted_files):
                    return f"{hook_name} implemented in {path}"
        return None


if __name__ == "__main__":
    main()
