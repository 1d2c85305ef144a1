import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every slow multi-process case, not only the representative subset marked `ci`")


def pytest_sessionstart(session):
    """Compile the planner's numba loops once, here, before any test spawns ranks: numba caches what it compiles
    (``cache=True``), so the ranks of the multi-process tests load it instead of compiling it in every process at
    once (on a loaded 2-core machine that outlasted their fault timeouts)."""
    from lightning_mm.attention import mask as masks
    from lightning_mm.parallel.context import distribute

    for layout in ("ee", "mp"):  # without and with segment ids: numba compiles each signature
        bam, segments = masks.random_bam(layout, 96, num_encoders=2, batch=1, seed=0, mean_item_tokens=8)
        distribute(bam, 2, "lpt", 16, segments)
        masks.block_workload(bam, 16, segments)


def pytest_collection_modifyitems(config, items):
    _check_capability_markers(items)
    _skip_slow_outside_ci(config, items)


def _check_capability_markers(items):
    """A ``combines`` / ``refuses`` marker naming an unknown capability (or malformed) fails collection: the
    compatibility page (docs/compatibility.md) is generated from these markers."""
    from capabilities import marker_problem

    for item in items:
        for mark in (*item.iter_markers("combines"), *item.iter_markers("refuses")):
            if problem := marker_problem(mark.name, mark.args, mark.kwargs):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{mark.name}{mark.args}: {problem}")


def _skip_slow_outside_ci(config, items):
    """By default, slow cases (multi-process, or long in one process) run only when also marked ``ci``: a
    representative case per capability (every placement, dp, pp, cp, the Lightning contracts, faults, memory) that
    keeps the suite within 20 minutes on a slow 2-core CPU. ``--full`` (or ``LMM_FULL_TESTS=1``) runs every test."""
    if config.getoption("--full") or os.environ.get("LMM_FULL_TESTS", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow case outside the representative subset; `--full` runs it")
    for item in items:  # markers, not keywords: a keyword also matches a folder name (a clone in ".../ci/")
        if item.get_closest_marker("slow") and not item.get_closest_marker("ci"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launcher writes LOCAL_RANK, NODE_RANK, WORLD_SIZE and MASTER_* into ``os.environ`` whenever a
    test runs a Trainer with a DDP-based strategy in this process; a later test's subprocess inheriting LOCAL_RANK
    would believe another launcher started its ranks and wait for them forever. Each test gets the environment
    back as it found it, and a process group such a test left behind is destroyed (a later test checks that bad
    input fails before any exists)."""
    import torch.distributed as dist

    saved, had_group = dict(os.environ), dist.is_initialized()
    yield
    os.environ.clear()
    os.environ.update(saved)
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()
