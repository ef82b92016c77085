"""``python -m dpu_pipe``: the ``dpu-pipe`` command line."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
