"""``dpu_pipe.distributed.init_process_group`` leaves nothing running once the group is
destroyed: no gloo thread outlives ``destroy_process_group`` to run on into interpreter
shutdown, where one that takes the GIL aborts the process."""
import json
import subprocess
import sys
import textwrap

import pytest

from helpers import free_port, repo_env

pytest.importorskip("torch")

#: The threads of a gloo group and of its TCP store (their names in /proc).
GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"}

_SCRIPT = textwrap.dedent("""
    import json, os
    import torch
    import torch.distributed as dist
    from dpu_pipe.distributed import init_process_group

    def threads():
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                      for t in os.listdir("/proc/self/task"))

    init_process_group("gloo")
    # What a training script does after starting its group: an optimizer (which imports
    # torch.distributed.nn through torch._dynamo), a step and a collective.
    w = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    w.sum().backward()
    opt.step()
    t = torch.ones(2)
    dist.all_reduce(t)
    during = threads()          # a gloo thread ran the collective: it has named itself
    dist.destroy_process_group()
    print(json.dumps({"during": during, "after": threads(), "sum": t.tolist()}))
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_destroying_the_group_ends_its_threads(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(_SCRIPT)
    env = repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                   WORLD_SIZE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sum"] == [1.0, 1.0]
    assert "pt_gloo_runloop" in out["during"], out["during"]
    assert not GLOO_THREADS & set(out["after"]), out["after"]


_EXIT_SCRIPT = textwrap.dedent("""
    import time
    import torch
    import torch.distributed as dist
    from dpu_pipe.distributed import init_process_group

    info = init_process_group("gloo")
    torch.optim.SGD([torch.ones(1, requires_grad=True)], lr=0.1)   # imports torch._dynamo
    t = torch.ones(4)
    if info.rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    # The callback runs on rank 0's gloo thread, once rank 1 joins: after rank 0 has left
    # its script, unless destroying the group waits for the collective.
    done = work.get_future().then(lambda fut: None)
    if info.rank == 1:
        work.wait()
    del work, done
    dist.destroy_process_group()

    class Shutdown:
        def __del__(self, sleep=time.sleep):
            sleep(2.0)          # during interpreter shutdown, the GIL released

    keep = Shutdown()
    print("exiting", info.rank, t.tolist(), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_collective_ending_after_its_script_does_not_abort_the_exit(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                           RANK=str(rank), WORLD_SIZE="2",
                                           OMP_NUM_THREADS="1"))
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:         # only the ranks this test started, should one hang
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}: exit {p.returncode}\n{err[-4000:]}"
        assert f"exiting {rank} [2.0, 2.0, 2.0, 2.0]" in out, out
