"""The package version, in a module of its own: modules inside the package read it from here,
never from the package root (see tests/test_layers.py). Keep equal to pyproject.toml's."""

__version__ = "0.1.0"
