"""Instructions a Cortex-A72 core executes per image in the region decodes of the batch kernel,
counted under emulation: bench/aarch64_decode.c (the decode paths without Python) built with
the aarch64 cross compiler and the build's flags against the cross sysroot of
scripts/build_wheels.sh (glibc 2.31, libjpeg-turbo 2.0.6 as on Ubuntu 20.04 DPU images), run by
``qemu-aarch64-static -cpu cortex-a72 -singlestep -d nochain,exec`` (one translation block per
instruction, each logged when it executes), the log counted through a FIFO.

    python bench/bench_aarch64_instructions.py [--n 12]

Each method runs once over the n images' RandomResizedCrop boxes (seed 0, epoch 0) at the DCT
scale the Loader picks for 224; ``none`` reads the same inputs without decoding, and a
method's count per image is (its count - none's) / n. The images: the first n baseline
ImageNet-like sample images (real photographs), as files and as the records of a transcoded
pack (lossless, a restart marker every MCU). For libjpeg-turbo on the pack, the harness decodes
the sub-stream ``dpu_pipe._jpeg.assemble`` builds (the assembly itself, about 6 % of a
sample's time on x86-64, is not counted). The same harness built natively checks first that
the own decoder's pixels equal libjpeg-turbo's for every box.

Instructions, not time: qemu does not model the A72's pipeline, so neither the latency that
interleaving would hide nor mispredicted branches show in these counts.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SRC = Path(__file__).resolve().parent / "aarch64_decode.c"
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno",
         "-I", str(REPO / "src" / "dpu_pipe")]


def sysroot():
    cache = Path(os.environ.get("DPU_PIPE_CROSS_CACHE",
                                Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                                / "dpu_pipe-cross"))
    root = cache / "sysroot" / "bullseye-arm64"
    if not (root / "usr" / "include" / "jpeglib.h").exists():
        sys.exit(f"no arm64 sysroot at {root}: run scripts/build_wheels.sh --arch aarch64 once")
    return root


def count(argv, root):
    """Instructions the emulated run of ``argv`` executes, and its standard output."""
    with tempfile.TemporaryDirectory() as tmp:
        fifo = Path(tmp) / "trace"
        os.mkfifo(fifo)
        total = [0]

        def read():
            with open(fifo, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    total[0] += chunk.count(b"Trace ")
        reader = threading.Thread(target=read)
        reader.start()
        proc = subprocess.run(["qemu-aarch64-static", "-L", str(root), "-cpu", "cortex-a72",
                               "-singlestep", "-d", "nochain,exec", "-D", str(fifo), *argv],
                              capture_output=True, text=True, timeout=7200)
        reader.join()
    if proc.returncode:
        sys.exit(f"{argv}: {proc.stderr[-2000:]}")
    return total[0], proc.stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=12)
    args = ap.parse_args(argv)

    from dpu_pipe import _huffman, _jpeg, jpeg
    from dpu_pipe.rng import random_resized_crop
    from dpu_pipe.tools.sample_data import dataset_files, sample_dataset

    root = sysroot()
    paths, _ = dataset_files(sample_dataset(max(4 * args.n, 64), progress=False))
    inputs = {"file": [], "pack": [], "assembled": []}
    for p in paths:
        data = p.read_bytes()
        h = _huffman.header(np.frombuffer(data, np.uint8))
        if h is None:                 # progressive: libjpeg-turbo's alone
            continue
        i = len(inputs["file"])
        top, left, bh, bw = (int(v) for v in random_resized_crop(0, 0, i, h["height"],
                                                                  h["width"]))
        scale = _jpeg.py_choose_scale(bh, bw, 224, 224)
        r0, c0 = top * scale // 8, left * scale // 8
        sh, sw = -(-h["height"] * scale // 8), -(-h["width"] * scale // 8)
        region = (r0, c0, min(-(-(top + bh) * scale // 8), sh) - r0,
                  min(-(-(left + bw) * scale // 8), sw) - c0)
        packed = jpeg.transcode(data, restart_interval=1)
        sub = _jpeg.assemble(np.frombuffer(packed, np.uint8), (top, left, bh, bw), 224, 224)
        if sub is None:
            continue
        inputs["file"].append((data, scale, region))
        inputs["pack"].append((packed, scale, region))
        inputs["assembled"].append((sub[0], sub[2], sub[1]))
        if len(inputs["file"]) == args.n:
            break
    n = len(inputs["file"])

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, items in inputs.items():
            blob, lines = bytearray(), []
            for data, scale, (t, l, hh, ww) in items:
                lines.append(f"{len(blob)} {len(data)} {scale} {t} {l} {hh} {ww}")
                blob += data
            (tmp / f"{name}.bin").write_bytes(bytes(blob))
            (tmp / f"{name}.txt").write_text("\n".join(lines) + "\n")
        cc = shutil.which("cc") or "gcc"
        subprocess.run([cc, *FLAGS, str(SRC), "-o", str(tmp / "x86"), "-ljpeg", "-lm"],
                       check=True)
        subprocess.run(["aarch64-linux-gnu-gcc", f"--sysroot={root}", "-march=armv8-a",
                        "-mtune=cortex-a72", *FLAGS, str(SRC), "-o", str(tmp / "arm"),
                        "-ljpeg", "-lm"], check=True)

        def run_native(method, name):
            out = subprocess.run([str(tmp / "x86"), method, str(tmp / f"{name}.txt"),
                                  str(tmp / f"{name}.bin")], check=True, capture_output=True,
                                 text=True).stdout
            return out.split()

        for name in ("file", "pack"):
            own, lj = run_native("own", name), run_native("libjpeg", name)
            assert own == lj, f"{name}: own and libjpeg-turbo pixels differ"
        assert run_native("libjpeg", "assembled") == run_native("libjpeg", "file")

        runs = {
            "libjpeg-turbo, file": ("libjpeg", "file"),
            "own, file": ("own", "file"),
            "own entropy, file": ("entropy", "file"),
            "libjpeg-turbo, pack (sub-stream)": ("libjpeg", "assembled"),
            "own, pack": ("own", "pack"),
            "own entropy, pack": ("entropy", "pack"),
        }
        base = {}
        for name in ("file", "pack", "assembled"):
            base[name], _ = count([str(tmp / "arm"), "none", str(tmp / f"{name}.txt"),
                                   str(tmp / f"{name}.bin")], root)
        got = {}
        for label, (method, name) in runs.items():
            c, out = count([str(tmp / "arm"), method, str(tmp / f"{name}.txt"),
                            str(tmp / f"{name}.bin")], root)
            if method != "entropy":
                assert out.split() == run_native(method, name), f"{label}: aarch64 != x86-64"
            got[label] = (c - base[name]) / n
    print(f"aarch64 (qemu -cpu cortex-a72; -O3 -march=armv8-a -mtune=cortex-a72, libjpeg-turbo "
          f"2.0.6), {n} baseline images, RandomResizedCrop boxes at the scale for 224; "
          f"instructions per image")
    for label, v in got.items():
        print(f"  {label:34s} {v / 1e6:8.2f} M")


if __name__ == "__main__":
    main()
