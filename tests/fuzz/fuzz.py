"""Coverage-guided fuzzing of one target with atheris (libFuzzer).

    python tests/fuzz/fuzz.py TARGET [libFuzzer options] [CORPUS_DIR ...]

TARGET is one of targets.TARGETS. Run it under scripts/asan/python.sh so the extensions and
libjpeg are checked by ASan+UBSan and their edges guide the fuzzer; with a plain build (gcc,
which cannot emit the coverage counters libFuzzer reads) only the Python code's edges are
seen: dpu_pipe's modules and the targets' own, which for the decoder targets (their work is
all in the extensions) is a few dozen edges, so the fuzzer mutates nearly blind. It says so
when it starts. tests/fuzz/run.sh runs every target with seeds.
"""

import logging
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["dpu_pipe", "targets"]):
    import dpu_pipe.jpeg  # noqa: F401
    import dpu_pipe.packed  # noqa: F401
    import dpu_pipe.sources  # noqa: F401
    import dpu_pipe.batch  # noqa: F401
    import dpu_pipe.kernel  # noqa: F401
    import dpu_pipe.transforms  # noqa: F401
    import targets


def native_coverage():
    """True when the extensions carry libFuzzer's edge counters (clang
    -fsanitize=fuzzer-no-link, scripts/asan/build.sh): their section names are in the file."""
    from dpu_pipe import _jpeg

    with open(_jpeg.__file__, "rb") as f:
        return b"__sancov_cntrs" in f.read()


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: fuzz.py {{{','.join(targets.TARGETS)}}} [libFuzzer options] [corpus]")
    name = sys.argv.pop(1)
    fn = targets.TARGETS[name]
    if not native_coverage():
        print(f"fuzz.py {name}: the extensions have no coverage counters (plain build): "
              f"only Python edges guide the fuzzer; scripts/asan/build.sh and "
              f"scripts/asan/python.sh for native edges and sanitizers", file=sys.stderr)
    # on_error="skip" logs each bad sample: millions of lines for nothing.
    logging.getLogger("dpu_pipe").setLevel(logging.ERROR)
    atheris.Setup(sys.argv, fn)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
