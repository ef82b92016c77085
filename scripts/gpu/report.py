"""Last step of ``scripts/gpu_check.sh``: the report of a run, from its steps' records::

    python scripts/gpu/report.py --results DIR --out REPORT.md [--expect a,b,c] \\
        [--fail-step NAME:STATUS:LOGFILE ...]

``--fail-step`` records a step that ended without writing its record (crashed, timed out:
``STATUS`` 124 or 137), with the tail of its log. Prints the report and writes it to
``REPORT.md``. Exit status 0 when every expected step is there and passed, else 1.
"""
import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, read_results, write_result  # noqa: E402

ORDER = {"preflight": 0, "cuda-tests": 1, "offload": 2, "copy-timing": 3, "train": 4}


def record_failure(folder, spec):
    """Write the record of a step that left none: ``spec`` is ``NAME:STATUS:LOGFILE``."""
    name, status, logfile = spec.split(":", 2)
    tail = ""
    if os.path.exists(logfile):
        with open(logfile, errors="replace") as f:
            tail = f.read()[-2000:]
    why = "timed out" if status in ("124", "137") else f"exit {status}"
    checks = Checks()
    checks.add("ran to the end", False, f"{why}; log tail:\n{tail}")
    write_result(os.path.join(folder, f"{name}.json"), name, checks, f"{why}, no record",
                 order=ORDER.get(name, 9))


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(results, expect):
    """The report (markdown) of ``results`` (the step records) and whether it passed."""
    info = next((r.get("info", {}) for r in results if r["step"] == "preflight"), {})
    steps = {r["step"]: r for r in results}
    missing = [s for s in expect if s not in steps]
    ok = not missing and all(r["ok"] for r in results)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# dpu_pipe GPU check: {'PASS' if ok else 'FAIL'}", "",
             f"- date: {now}",
             f"- GPU: {info.get('gpu', '?')} ({info.get('gpu_memory_gib', '?')} GiB, "
             f"capability {info.get('capability', '?')}, {info.get('gpu_count', '?')} visible)",
             f"- torch {info.get('torch', '?')} (CUDA {info.get('torch_cuda', '?')}), "
             f"Python {info.get('python', '?')}",
             f"- dpu_pipe {info.get('dpu_pipe', '?')} from {info.get('dpu_pipe_file', '?')}",
             f"- MPI: {info.get('mpi_library', '?')}; mpi4py {info.get('mpi4py', '?')}", "",
             "| step | result | summary |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['step']} | {'pass' if r['ok'] else 'FAIL'} | "
                     f"{_cell(r['summary'])} |")
    for s in missing:
        lines.append(f"| {s} | FAIL | did not run |")
    timing = steps.get("copy-timing")
    if timing and timing.get("times"):
        lines += ["", f"Batch to the GPU ({timing['dtype']}, {timing['shape']}, "
                  f"{timing['batch_bytes'] / 1e6:.1f} MB), median (min-max) ms over "
                  f"{timing['times']['window']['total_ms']['n']} batches:", "",
                  "| path | call returns | copy done | copy stream | GB/s |", "|---|---|---|---|---|"]
        for name, t in timing["times"].items():
            def cell(k):
                v = t.get(k)
                return f"{v['median']} ({v['min']}-{v['max']})" if v else "-"
            lines.append(f"| {name} | {cell('host_ms')} | {cell('total_ms')} | "
                         f"{cell('stream_ms')} | {t.get('GB_per_s', '-')} |")
        ov = timing.get("overlap", {})
        if ov:
            lines += ["", f"Overlap of the copy of batch k+1 with compute on batch k "
                      f"({timing.get('matmuls_per_iteration')} fp16 8192² matrix products per step):",
                      "", "| path | median share of the copy inside the compute | copy ms | "
                      "compute ms |", "|---|---|---|---|"]
            for name, o in ov.items():
                lines.append(f"| {name} | {o.get('median_share')} | {o['copy_ms']['median']} "
                             f"| {o['compute_ms']['median']} |")
    failed = [(r["step"], c) for r in results for c in r["checks"] if not c["ok"]]
    if failed:
        lines += ["", "Failed checks:", ""]
        for step, c in failed:
            lines.append(f"- {step}: {c['name']}: {c['detail'][:1500]}")
    return "\n".join(lines) + "\n", ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", required=True, action="append", help="report file (repeatable)")
    ap.add_argument("--expect", default=",".join(ORDER), help="steps that must be there")
    ap.add_argument("--fail-step", action="append", default=[], metavar="NAME:STATUS:LOG")
    args = ap.parse_args(argv)
    for spec in args.fail_step:
        record_failure(args.results, spec)
    text, ok = render(read_results(args.results), [s for s in args.expect.split(",") if s])
    for path in args.out:
        with open(path, "w") as f:
            f.write(text)
    print(text, end="", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
