"""Shared fixtures. The tiny model is built once per test session into a temporary cache."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

_CACHE = Path(os.environ.setdefault("ROLLPLEX_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "test")))

os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(_CACHE / "dask"))  # not /tmp: CI leaves no strays

from rollplex import runtime  # noqa: E402

# One OMP team per core: under `-n auto` each pytest worker gets cores ÷ workers threads. With two
# threads per worker on two cores, a torch-graph decode test took 153–163 s instead of 14 s on an
# Intel Xeon host (OMP's barriers spin against the other worker's threads).
# Set, not defaulted: xdist's workers inherit the environment of the controller, which imported this
# file before it counted any workers.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = int(os.environ.get("ROLLPLEX_TEST_THREADS", max(1, (os.cpu_count() or 1) // _WORKERS)))
os.environ["OMP_NUM_THREADS"] = str(_THREADS)
runtime.configure(threads=_THREADS)


@pytest.fixture
def torch_threads():
    """A setter of torch's intra-op threads for one test; the count it found comes back after it.
    torch._C's own setter: once vLLM's CPU worker has loaded in this process, torch.set_num_threads
    is a no-op, and a count a test left behind would change the bits of later tests' runs."""
    import torch

    before = torch.get_num_threads()
    yield torch._C.set_num_threads
    torch._C.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from rollplex.engines.models import ensure_tiny_vlm
    from rollplex.tasks.data import default_model_spec

    return ensure_tiny_vlm(default_model_spec(), _CACHE)


# The longest files, longest first (`pytest -m "not gpu" -n auto --dist loadfile`, each file's test
# times summed: 197, 128, 71, 66, 63, 59, 57, 47, 46, 43, 34 and 33 s on 2 Intel Xeon cores). Under the
# README's `-n auto --dist loadfile` each starts as soon as a worker is free while the short files fill
# the gaps, instead of starting last and running on alone.
LONGEST_FIRST = ("test_distributed.py", "test_kill.py", "test_sockets.py", "test_evaluation.py", "test_lora_run.py",
                 "test_e2e.py", "test_bad_input.py", "test_multiturn.py", "test_determinism.py",
                 "test_decode_engines.py", "test_tutorial.py", "test_external_cluster.py")


def pytest_configure(config):
    # pytest-xdist 3.7+ hands loadfile's files out by their number of tests, most first, unless told
    # not to: the long files of few tests (test_kill's 3, test_determinism's 2) then start last.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
