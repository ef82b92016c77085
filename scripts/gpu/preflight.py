"""First step of ``scripts/gpu_check.sh``: everything the check needs, short of the GPU.

    python scripts/gpu/preflight.py --result R.json [--mpi-timeout 60]

Imports dpu_pipe (and decodes a JPEG with its kernels), torch, mpi4py, Pillow, OpenCV,
pytest and its timeout plugin, reads a scikit-image sample photo (the tests' data helpers
do), and starts a 2-rank job with ``mpiexec`` (an allreduce over mpi4py). Then it asks torch
for a CUDA device. Exit status: 0 with a GPU, 1 when anything else is missing (each missing
piece named), 3 when all of it is there but no GPU is ("no GPU" printed), so that a broken
install shows on a machine without one.
"""
import argparse
import importlib
import io
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Checks, write_result  # noqa: E402

NO_GPU = 3

MPI_PROBE = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
             "s = c.allreduce(c.Get_rank() + 1); assert s == 3, s; "
             "c.Get_rank() or print(MPI.Get_library_version().splitlines()[0].strip())")


def _module(checks, name, info, attr="__version__"):
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is what is reported
        checks.add(f"import {name}", False, f"{type(exc).__name__}: {exc}")
        return None
    version = getattr(mod, attr, "?")
    info[name] = str(version)
    checks.add(f"import {name}", True, str(version))
    return mod


def _dpu_pipe(checks, info):
    dpu_pipe = _module(checks, "dpu_pipe", info)
    if dpu_pipe is None:
        return
    info["dpu_pipe_file"] = os.path.dirname(dpu_pipe.__file__)
    try:
        import numpy as np
        from PIL import Image

        from dpu_pipe import jpeg

        img = np.zeros((24, 40, 3), np.uint8)
        img[:, :20] = (200, 30, 60)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        out = np.asarray(jpeg.decode(buf.getvalue()))
        ok = out.shape == (24, 40, 3) and abs(int(out[12, 5, 0]) - 200) < 8
        checks.add("dpu_pipe kernels decode a JPEG", ok, f"shape {out.shape}")
    except Exception as exc:  # noqa: BLE001
        checks.add("dpu_pipe kernels decode a JPEG", False, f"{type(exc).__name__}: {exc}")


def _skimage_photo(checks):
    try:
        import skimage.data

        a = skimage.data.astronaut()
        where = os.path.dirname(skimage.data.__file__)
        checks.add("skimage.data sample photos (tests' data)", a.shape == (512, 512, 3),
                   f"astronaut {a.shape} from {where}")
    except Exception as exc:  # noqa: BLE001
        checks.add("skimage.data sample photos (tests' data)", False,
                   f"{type(exc).__name__}: {exc} (install scikit-image, or let gpu_check.sh "
                   f"serve the wheelhouse's photos/)")


def _mpi(checks, info, timeout):
    try:
        from dpu_pipe.mpi import mpiexec_path

        mpiexec = mpiexec_path()
    except Exception as exc:  # noqa: BLE001
        checks.add("mpiexec present", False, f"{type(exc).__name__}: {exc}")
        return
    checks.add("mpiexec present", True, mpiexec)
    info["mpiexec"] = mpiexec
    argv = [mpiexec, "-n", "2", sys.executable, "-c", MPI_PROBE]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        checks.add("mpiexec -n 2 runs mpi4py", False, f"no end within {timeout} s")
        return
    ok = proc.returncode == 0
    text = proc.stdout.strip() if ok else (proc.stdout + proc.stderr).strip()[-1500:]
    checks.add("mpiexec -n 2 runs mpi4py", ok, text)
    if ok:
        info["mpi_library"] = text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", required=True, help="JSON record of this step")
    ap.add_argument("--mpi-timeout", type=float, default=60.0, help="seconds")
    args = ap.parse_args(argv)

    checks = Checks()
    info = {"python": f"{platform.python_version()} ({sys.executable})"}
    _dpu_pipe(checks, info)
    torch = _module(checks, "torch", info)
    _module(checks, "mpi4py", info)
    for name in ("numpy", "PIL", "cv2", "pytest", "pytest_timeout"):
        _module(checks, name, info)
    _skimage_photo(checks)
    _mpi(checks, info, args.mpi_timeout)
    for c in checks.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}", flush=True)
    if not checks.ok:
        missing = ", ".join(c["name"] for c in checks.failed())
        write_result(args.result, "preflight", checks, f"missing: {missing}", info=info,
                     order=0)
        print(f"preflight failed: {missing}", flush=True)
        return 1

    info["torch_cuda"] = str(torch.version.cuda)
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if not gpu:
        checks.add("a CUDA device", False, f"torch {torch.__version__} (CUDA "
                   f"{torch.version.cuda}) sees none")
        write_result(args.result, "preflight", checks, "no GPU", info=info, order=0)
        print(f"no GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA "
              f"device; every import and the MPI launch are fine", flush=True)
        return NO_GPU
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                capability=f"{props.major}.{props.minor}")
    checks.add("a CUDA device", True, f"{props.name}, {info['gpu_memory_gib']} GiB, "
               f"capability {info['capability']}")
    write_result(args.result, "preflight", checks, f"{props.name}; torch {torch.__version__} "
                 f"CUDA {torch.version.cuda}", info=info, order=0)
    print(f"GPU: {props.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
