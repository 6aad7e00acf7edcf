"""docs/gallery/ holds every built-in algorithm's compiled iteration, rendered by scripts/gallery.sh,
and each picture is current: rendering it again gives the same bytes."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollplex.pipeline.run.algorithms import builtin_algorithms

ROOT = Path(__file__).resolve().parents[1]
GALLERY = ROOT / "docs" / "gallery"


def test_every_builtin_algorithm_is_in_the_gallery_and_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in builtin_algorithms():
        assert (GALLERY / f"{name}.svg").exists(), f"run scripts/gallery.sh: docs/gallery/{name}.svg is missing"
        assert f"docs/gallery/{name}.svg" in readme, f"README does not link docs/gallery/{name}.svg"
    loop = next(x for x in (ROOT / "scripts" / "gallery.sh").read_text().splitlines() if x.startswith("for alg in "))
    assert set(loop.removeprefix("for alg in ").split(";")[0].split()) == set(builtin_algorithms())


@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "dapo", "reinforce_pp"])
def test_gallery_picture_is_current(tmp_path, name):
    from rollplex.cli import main

    out = tmp_path / f"{name}.svg"
    args = (GALLERY / "ARGS").read_text().split()
    assert main(["graph", *args, "--set", f"algorithm={name}", "--format", "svg", "--out", str(out)]) == 0
    assert out.read_bytes() == (GALLERY / f"{name}.svg").read_bytes(), \
        f"docs/gallery/{name}.svg is stale: run scripts/gallery.sh"
