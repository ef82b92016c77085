"""The fault matrix: each fault injected into a real job (1 host, 2 producer ranks, mpiexec,
oversubscribed), per mode. For each cell: how the job ended (completed exactly once / clear
error naming the rank / job ended), seconds from the injection to its detection, and whether
any rank of the job outlived it (checked by pid).

    python tests/mpi/fault_matrix.py [--modes offload,hybrid] [--json PATH] [--root DIR]

``--root`` runs the ranks against another checkout of dpu_pipe (default: this one).

Faults: producer SIGKILL; SIGSTOP mid-epoch and between epochs; one producer 10x slower; an
exception in a producer's decode path that is not a DecodeError; an exception in the host
mid-epoch; the host SIGKILLed; a window that cannot be allocated (the host's ``Win.Allocate`` made to
fail with ERR_NO_MEM, as when /dev/shm is full); the dataset unreachable from the producers.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))     # tests/, for helpers
sys.path.insert(0, ROOT)

from helpers import make_dataset  # noqa: E402

FAULTS = ("none", "kill", "stop_mid", "stop_between", "slow", "raise", "host_raise",
          "host_killed", "window_alloc", "unreachable")
WORKER_FAULTS = {"slow", "raise", "unreachable"}
LIVENESS = 5.0


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_cell(fault, mode, data, limit=90, root=ROOT):
    from dpu_pipe.mpi import mpiexec_argv

    out = tempfile.mkdtemp(prefix=f"fault-{fault}-")
    worker = ([os.path.join(HERE, "reliability_host.py"), "worker", "--fault", fault,
               "--data-root", data] if fault in WORKER_FAULTS else ["-m", "dpu_pipe.worker"])
    argv = ["timeout", "-k", "5", str(limit), *mpiexec_argv(
        1, os.path.join(HERE, "reliability_host.py"), "fault", "--fault", fault,
        "--mode", mode, "--data", data, "--out", out, "--epochs", "3",
        "--liveness", str(LIVENESS), "--timeout", "30",
        ":", "-n", "2", sys.executable, "-m", "mpi4py", *worker)]
    env = dict(os.environ, PYTHONPATH=root)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=limit + 20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    end_wall, seconds = time.time(), time.monotonic() - t0

    def read(name):
        try:
            with open(os.path.join(out, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    pids, err, ok = read("pids.json"), read("error0.json"), read("fault.json")
    time.sleep(1.0)
    left = [p for p in ([pids["host"]] + pids["producers"] if pids else []) if alive(p)]
    for p in left:   # leave nothing behind for the next cell
        try:
            os.kill(p, signal.SIGCONT)
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if proc.returncode in (124, 137) or seconds > limit:
        outcome = f"HUNG: killed at the {limit} s limit"
        inj = read("injected.json")
        detect = None
        what = ""
    elif ok is not None:
        outcome = "completed, exactly once" if ok.get("exactly_once") else "completed, WRONG stream"
        detect = ok.get("seconds_after_injection")
        what = ""
    elif err is not None:
        outcome = f"{err['type']}"
        detect = err.get("seconds_after_injection")
        if detect is None and read("injected.json"):
            detect = end_wall - read("injected.json")["t"]
        what = err["message"].splitlines()[0][:160]
    else:
        outcome = "job ended"
        inj = read("injected.json")
        detect = (end_wall - inj["t"]) if inj else None
        lines = [ln for ln in stderr.splitlines()
                 if any(w in ln for w in ("BAD TERMINATION", "KILLED", "Abort", "signal",
                                          "Error", "error"))]
        what = (lines or [""])[0].strip()[:160]
    return {"fault": fault, "mode": mode, "returncode": proc.returncode,
            "outcome": outcome, "detect_s": None if detect is None else round(detect, 2),
            "job_s": round(seconds, 2), "left_behind": left, "message": what,
            "pids": pids}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="offload")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--json")
    ap.add_argument("--root", default=ROOT)
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    data = make_dataset(tempfile.mkdtemp(prefix="fault-data-"), 48)
    rows = []
    print("| mode | fault | outcome | detected after s | job s | exit | ranks left | message |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for fault in args.faults.split(","):
            r = run_cell(fault, mode, data, root=args.root)
            rows.append(r)
            print(f"| {mode} | {fault} | {r['outcome']} | {r['detect_s']} | {r['job_s']} | "
                  f"{r['returncode']} | {len(r['left_behind'])} | {r['message']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
