"""The version of dpu_pipe, in one place below the package root (pyproject.toml repeats it)."""

__version__ = "0.1.0"
