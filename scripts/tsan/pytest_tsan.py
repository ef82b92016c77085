"""pytest plugin of the ThreadSanitizer run (scripts/tsan/check.sh loads it with -p).

It refuses to start unless dpu_pipe is imported from the TSAN build with the TSAN runtime in
the process (a run that silently tested the plain build would pass for the wrong reason), and
fails the test during which TSAN wrote a report, with the report as its message. TSAN writes
reports to ``$DPU_PIPE_TSAN_LOGS/tsan.<pid>`` (scripts/tsan/python.sh sets both); a report
that a background thread makes after its test has ended is charged to the test running then.
"""
import glob
import os

import pytest

MARK = "WARNING: ThreadSanitizer"
_KEY = pytest.StashKey[dict]()   # log file -> bytes already charged to a test


def _logs():
    return sorted(glob.glob(os.path.join(os.environ.get("DPU_PIPE_TSAN_LOGS", ""), "tsan.*")))


def _sizes():
    return {p: os.path.getsize(p) for p in _logs()}


def pytest_configure(config):
    tree = os.environ.get("DPU_PIPE_TSAN_TREE")
    if not tree or not os.environ.get("DPU_PIPE_TSAN_LOGS"):
        raise pytest.UsageError("pytest_tsan: run pytest through scripts/tsan/python.sh")
    import dpu_pipe

    where = os.path.realpath(dpu_pipe.__file__)
    if not where.startswith(os.path.realpath(tree) + os.sep):
        raise pytest.UsageError(f"pytest_tsan: dpu_pipe comes from {where}, not from the "
                                f"TSAN build in {tree}")
    with open("/proc/self/maps") as f:
        if "libtsan" not in f.read():
            raise pytest.UsageError("pytest_tsan: the TSAN runtime is not loaded")
    config.stash[_KEY] = _sizes()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "teardown":
        return
    before = item.config.stash[_KEY]
    now = _sizes()
    item.config.stash[_KEY] = now
    new = []
    for path, size in now.items():
        if size > before.get(path, 0):
            with open(path, errors="replace") as f:
                f.seek(before.get(path, 0))
                new.append(f.read())
    text = "".join(new)
    if MARK in text:
        rep = outcome.get_result()
        rep.outcome = "failed"
        rep.longrepr = f"ThreadSanitizer: {text.count(MARK)} report(s) during this test\n{text}"


def pytest_terminal_summary(terminalreporter):
    reports = 0
    lines = []
    for path in _logs():
        with open(path, errors="replace") as f:
            text = f.read()
        reports += text.count(MARK)
        lines += [ln for ln in text.splitlines() if ln.startswith("SUMMARY: ThreadSanitizer")]
    terminalreporter.write_sep("-", f"ThreadSanitizer: {reports} report(s) in "
                                    f"{os.environ['DPU_PIPE_TSAN_LOGS']}")
    for ln in sorted(set(lines)):
        terminalreporter.write_line(f"{lines.count(ln)} x {ln}")
