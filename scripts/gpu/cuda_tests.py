"""Step of ``scripts/gpu_check.sh``: the tests that skip without CUDA, run where there is one.

    python scripts/gpu/cuda_tests.py --tests DIR --result R.json [--timeout 300]

Finds them in the test files (:func:`discover`): functions marked
``skipif(not torch.cuda.is_available(), ...)`` (or skipped in their body when CUDA is not
available). Runs every test file holding one, whole (their other tests exercise the same
device code on a fake runtime), with pytest from ``DIR``'s parent, so the ranks its MPI tests
start import the installed dpu_pipe; then reads pytest's JUnit XML (:func:`check_junit`):
the step passes when nothing failed and each CUDA test *passed* (a skip is a failure here).
"""
import argparse
import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, write_result  # noqa: E402

__all__ = ["discover", "check_junit"]


def _mentions_cuda_available(node):
    return any(isinstance(n, ast.Attribute) and n.attr == "is_available"
               and isinstance(n.value, ast.Attribute) and n.value.attr == "cuda"
               for n in ast.walk(node))


def _skips_without_cuda(test):
    """True when ``test`` (a FunctionDef) is skipped, by a marker or in its body, when
    ``torch.cuda.is_available()`` is false."""
    for dec in test.decorator_list:
        if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) \
                and dec.func.attr == "skipif" and dec.args:
            cond = dec.args[0]
            if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not) \
                    and _mentions_cuda_available(cond.operand):
                return True
    for stmt in test.body:
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.UnaryOp) \
                and isinstance(stmt.test.op, ast.Not) and _mentions_cuda_available(stmt.test) \
                and any(isinstance(n, ast.Attribute) and n.attr == "skip"
                        for s in stmt.body for n in ast.walk(s)):
            return True
    return False


def discover(tests_dir):
    """Node ids (``path/relative/to/tests_dir/..::name``) of the test functions in
    ``tests_dir`` (recursively, ``test_*.py``) that skip without CUDA, sorted."""
    base = os.path.dirname(os.path.abspath(tests_dir))
    found = []
    for dirpath, dirnames, filenames in os.walk(tests_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for name in sorted(filenames):
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test") \
                        and _skips_without_cuda(node):
                    found.append(f"{rel}::{node.name}")
    return sorted(found)


def _node_id(case):
    """``path::name`` of a JUnit ``testcase`` (pytest writes ``classname`` as the dotted
    module path, parametrized names with their ``[id]``)."""
    module = case.get("classname", "").replace(".", "/")
    return f"{module}.py::{case.get('name', '')}"


def check_junit(xml_path, required):
    """Outcomes of a pytest JUnit XML file: a :class:`~common.Checks` (nothing failed or
    errored; every node id in ``required`` ran and passed — a parametrized one in each of its
    cases), and ``{"passed", "failed", "skipped"}`` counts."""
    checks = Checks()
    root = ET.parse(xml_path).getroot()
    outcome = {}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        else:
            state = "passed"
        outcome[_node_id(case)] = state
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    failed = sorted(k for k, v in outcome.items() if v == "failed")
    checks.add("no test failed", not failed and bool(outcome),
               ", ".join(failed) if failed else f"{counts}")
    for node in required:
        states = [v for k, v in outcome.items() if k == node or k.startswith(node + "[")]
        checks.add(f"passed with CUDA: {node}", bool(states) and set(states) == {"passed"},
                   ", ".join(states) if states else "did not run")
    return checks, counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", required=True, help="the tests/ folder to run (a copy)")
    ap.add_argument("--result", required=True, help="JSON record of this step")
    ap.add_argument("--timeout", type=int, default=300, help="pytest's per-test timeout, s")
    ap.add_argument("--list", action="store_true", help="print the CUDA tests and exit")
    args = ap.parse_args(argv)

    tests = os.path.abspath(args.tests)
    required = discover(tests)
    if args.list:
        print("\n".join(required))
        return 0
    files = sorted({n.split("::")[0] for n in required})
    base = os.path.dirname(tests)
    xml = os.path.splitext(args.result)[0] + ".junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--timeout={args.timeout}", f"--junitxml={xml}", *files]
    print(f"CUDA tests: {len(required)} in {len(files)} files", flush=True)
    for n in required:
        print(f"  {n}", flush=True)
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=base) if files else 5
    if not os.path.exists(xml):
        checks = Checks()
        checks.add("pytest ran", False, f"exit {rc}, no JUnit XML"
                   + ("" if required else " (no CUDA test found)"))
        write_result(args.result, "cuda-tests", checks, f"pytest exit {rc}", order=1)
        return 1
    checks, counts = check_junit(xml, required)
    checks.add("pytest exit status 0", rc == 0, f"exit {rc}")
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} "
               f"skipped in {', '.join(files)}; CUDA-only: {len(required)}")
    write_result(args.result, "cuda-tests", checks, summary, cuda_tests=required,
                 counts=counts, order=1)
    print(summary, flush=True)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
