"""Command-line tools built on the library: the ``dpu-pipe`` CLI, the demo, benchmarks and the
sample-data generator. Nothing in the library imports from here."""
