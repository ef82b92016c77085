"""Coverage-guided fuzzing of one target with atheris (libFuzzer).

    python tests/fuzz/fuzz.py TARGET [libFuzzer options] [CORPUS_DIR ...]

TARGET is one of targets.TARGETS. Run it under scripts/asan/python.sh so the extensions and
libjpeg are checked by ASan+UBSan and their edges guide the fuzzer; with a plain build only
the Python code's edges are seen. tests/fuzz/run.sh runs every target with seeds.
"""

import logging
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["dpu_pipe"]):
    import dpu_pipe.jpeg  # noqa: F401
    import dpu_pipe.packed  # noqa: F401
    import dpu_pipe.sources  # noqa: F401
    import dpu_pipe.steps  # noqa: F401
    import dpu_pipe.batch  # noqa: F401
    import dpu_pipe.transforms  # noqa: F401

import targets  # noqa: E402


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: fuzz.py {{{','.join(targets.TARGETS)}}} [libFuzzer options] [corpus]")
    fn = targets.TARGETS[sys.argv.pop(1)]
    # on_error="skip" logs each bad sample: millions of lines for nothing.
    logging.getLogger("dpu_pipe").setLevel(logging.ERROR)
    atheris.Setup(sys.argv, fn)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
