"""Fixtures shared by the test files: datasets made once per session and read by every file
that asks for the same one. Tests must not write into a session dataset; the helpers behind
them live in ``tests/helpers.py``, which the scripts run under mpiexec import too.

pytest puts this directory on ``sys.path`` (rootdir-relative conftest, no ``__init__.py``),
so ``import helpers`` and the other modules here work from ``tests/mpi/`` as well.
"""
import pytest

import helpers


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """``photo_folder(n, classes=None, shape=(40, 3, 50, 2), quality=75)``: the path of an
    ImageFolder of ``n`` photographs written by :func:`helpers.photo_folder` with those
    arguments, made once per session (read-only)."""
    made = {}

    def get(n, classes=None, shape=(40, 3, 50, 2), quality=75):
        key = (n, classes, tuple(shape), quality)
        if key not in made:
            root = tmp_path_factory.mktemp("photos") / "ds"
            made[key] = helpers.photo_folder(root, n, classes=classes, shape=shape,
                                             quality=quality)
        return made[key]

    return get


@pytest.fixture(scope="session")
def mpi_dataset(tmp_path_factory):
    """``mpi_dataset(n, bad=None)``: the root (str) of :func:`helpers.make_dataset`'s
    ImageFolder of ``n`` samples, label == sample index, ``bad`` ``{index: kind}`` files that
    do not decode; made once per session (read-only)."""
    made = {}

    def get(n, bad=None):
        key = (n, tuple(sorted((bad or {}).items())))
        if key not in made:
            root = tmp_path_factory.mktemp("mpi-data") / "data"
            made[key] = helpers.make_dataset(str(root), n, bad=bad)
        return made[key]

    return get


@pytest.fixture(scope="session")
def format_folder(tmp_path_factory):
    """The ImageFolder (path, str) that ``dataset_formats`` writes other formats from:
    3 classes x 7 samples, a few of them PNG (read-only)."""
    import dataset_formats as dfm

    return dfm.make_folder(str(tmp_path_factory.mktemp("formats") / "folder"))


# The long form's tests: what ./run.sh test runs and CI (`-m "not long"`) leaves out to stay
# within its 15 minutes. Each is a further parameter, interpreter or scenario of a check that
# CI still runs in at least one form (named after the "#"); each is in the slow tier too.
LONG = (
    # the sdist installed with build isolation on 3.12 (offloaded) and 3.13 (abi3 wheel)
    "test_sdist.py::test_sdist_installs_into_a_fresh_venv_and_decodes",
    "test_sdist.py::test_install_matrix_sdist_on_each_python[3.9]",
    "test_sdist.py::test_install_matrix_sdist_on_each_python[3.11]",
    # bench-train: one local configuration
    "test_bench_train.py::test_bench_train_quick_writes_json_and_plots",
    "test_bench_train.py::test_bench_train_heavy_recipe_trains_with_soft_labels",
    # gpu_check: the dry run and the fake device's offload check
    "test_gpu_check.py::test_without_a_gpu_the_steps_can_still_run_and_the_report_names",
    # bench_blur: its parity tests in tests/test_blur.py
    "test_bench_scripts.py::test_bench_blur_times_every_method_and_case",
    # train_imagenet.py: stop and resume bit for bit, SIGTERM, progressive resolution
    "test_train_example.py::test_modes_give_the_same_metrics",
    "test_train_example.py::test_a_checkpoint_of_two_ranks_resumes_on_three",
    # RemoteValidation: 1 host x 1 producer, 2 hosts x 1 producer (uneven), errors
    "test_validation.py::test_metrics_equal_host_evaluation[1host-3prod]",
    "test_validation.py::test_metrics_equal_host_evaluation[2hosts-2prod-each]",
    "test_validation.py::test_submit_returns_while_training_goes_on",
    "test_threads_offload.py::test_remote_validation_from_threads_while_batches_flow",
    # the stream: 1 host x 2 producers (shm), 2 x 2 (off-node), the fallback host (shm)
    "test_offload.py::test_stream_equals_loader_exactly_once[1host-1worker",
    "test_offload.py::test_stream_equals_loader_exactly_once[1host-2workers-nolocal]",
    "test_offload.py::test_stream_equals_loader_exactly_once[1host-3workers",
    "test_offload.py::test_stream_equals_loader_exactly_once[2hosts-1worker-fallback-nolocal]",
    # the matrix: 3 producers on shm, 8 off-node
    "test_offload.py::test_stream_matrix_equals_loader[1-",
    "test_offload.py::test_stream_matrix_equals_loader[3-nolocal]",
    "test_offload.py::test_stream_matrix_equals_loader[8-shm]",
    # slow producers: on shm; every producer busy: 8 producers on 3 slots
    "test_offload.py::test_slow_random_producers_and_slow_consumer[nolocal]",
    "test_offload.py::test_every_producer_busy_whatever_the_slots[16x2slots]",
    "test_offload.py::test_a_host_waiting_for_a_slow_producer_sleeps_instead_of_polling[shm]",
    # other sources offloaded: tar on shm, Parquet off-node, a factory on shm
    "test_source_offload.py::test_offloaded_stream_over_other_sources[tar-nolocal]",
    "test_source_offload.py::test_offloaded_stream_over_other_sources[parquet-shm]",
    "test_source_offload.py::test_offloaded_stream_over_other_sources[factory-nolocal]",
    # the node cache: 2 producers (quick tier) and 3
    "test_node_cache.py::test_cached_offload_and_hybrid_equal_the_uncached_loader[1]",
)


# Out of the quick tier (-m "not slow") besides the tests marked slow where they are written:
# those that took 2.5 s or more here in it (load ~2). CI runs them. What the quick tier keeps
# of each area is named after the "#".
SLOW = (
    # the smoke runs of bench_cache, bench_transcode and bench_decode's JSON
    "test_bench_scripts.py::test_bench_views_times_every_method",
    "test_bench_scripts.py::test_bench_views_runs_the_methods_asked_for",
    "test_bench_scripts.py::test_bench_decode_argument_errors_name_the_flag",
    "test_bench_scripts.py::test_bench_loader_every_method_makes_every_batch",
    # the threads' stress in one thread of the Loader; the offloaded exit and Ctrl-C jobs
    "test_threads_offload.py::test_stress_every_method_from_every_thread",
    "test_threads_offload.py::test_exit_with_dpuloader_threads_alive[hybrid]",
    "test_threads.py::test_stress_every_method_from_every_thread[2]",
    # gpu_check: discovery, reports, the fake device's timings, refused steps
    "test_gpu_check.py::test_dry_run_without_a_gpu_exits_3_after_its_checks",
    "test_gpu_check.py::test_train_check_reads_the_run",
    # the scheduler: a scripted takeover and the property's own check
    "test_scheduler.py::test_random_interleavings_keep_the_invariants",
    # offload: decode errors, the last batch, two loaders, the window filled under the GIL
    "test_offload.py::test_hybrid_takes_over_a_stopped_producer[mid-epoch]",
    "test_offload.py::test_request_channel_answers_and_carries_errors",
    "test_offload.py::test_mixed_stream_equals_loader",
    "test_offload.py::test_local_mode_defaults_to_the_hosts_shard",
    "test_offload.py::test_host_map_naming_no_host_ends_the_job_with_the_reason",
    "test_offload.py::test_host_that_closes_early_ends_the_job",
    "test_offload.py::test_bad_samples_skip_then_raise[shm]",
    "test_elastic_offload.py::test_dpuloader_resumes_elastically[2to3]",
    "test_progressive_offload.py::test_progressive_stream_offloaded_equals_the_loader",
    "test_decode_max_side_offload.py::test_offloaded_decode_max_side_and_stick_to_shard",
    # the node cache: a partial fill keeps the stream; the in-process cache (test_cache*.py)
    "test_node_cache.py::test_corrupt_files_are_never_cached",
    "test_node_cache.py::test_a_writer_stalled_mid_fill_is_never_read_and_killing_it_ends_the",
    "test_node_cache.py::test_cached_offload_and_hybrid_equal_the_uncached_loader[2]",
    "test_node_cache.py::test_producer_memory_grows_by_at_most_what_the_cache_holds",
    # the blur: torchvision's and the float64 reference's parity, arguments, threads
    "test_blur.py::test_passes_bit_identical_across_targets[aarch64]",
    "test_blur.py::test_passes_bit_identical_across_targets[x86-64-sse2]",
    # the sample data: layout, labels, encoder mix, proportions, rebuilds
    "test_sample_data.py::test_same_seed_same_bytes_other_seed_other_bytes",
    "test_sample_data.py::test_corpus_is_real_colour_photographs",
    # the CLI: pack, info --build, errors and exit status
    "test_cli.py::test_info_summarises_folder_and_packed_dataset",
    "test_cli.py::test_info_summarises_tar_shards_and_parquet",
    # stick_to_shard: subsets, state, elastic resume, wire spec, memory
    "test_stick_to_shard.py::test_the_order_is_the_documented_one",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"
        if name.startswith(LONG):
            item.add_marker(pytest.mark.long)
            item.add_marker(pytest.mark.slow)
        elif name.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
