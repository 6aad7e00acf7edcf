"""A run that runs out of device memory, with no ``schedule: auto`` candidate left to drop: one line
naming the node and the settings that hold less at once, exit code 4, the last checkpoint intact,
and a resume with one of them changed finishing the run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from reliability_harness import HF_TORCH, ITERATIONS, Launch, assert_intact, metric_rows, run_to_end  # noqa: E402


def test_out_of_device_memory_names_the_node_and_what_holds_less_and_a_resume_with_it_finishes(tmp_path):
    run_dir = tmp_path / "oom"
    # The third loss node: iteration 1's first micro-batch, after iteration 0's checkpoint.
    launch = Launch(run_dir, HF_TORCH, {"ROLLPLEX_TEST_FAULT": "task:loss:before#3", "ROLLPLEX_TEST_FAULT_KILL": "oom",
                                        "ROLLPLEX_TEST_FAULT_ONCE": str(tmp_path / "fired")})
    rc = launch.finish()
    assert rc == 4, launch.log()
    said = [line for line in launch.stderr.splitlines() if "ran out of device memory" in line]
    assert len(said) == 1, launch.log()
    line = said[0]
    assert "iteration 1" in line and "(loss) ran out of device memory (OutOfMemoryError: CUDA out of memory" in line
    assert "nothing of this iteration was applied or written" in line and "iter_" in line
    for lever in ("train.gradient_checkpointing=true", "train.micro_batch_tokens=N", "cluster.memory_plan=true"):
        assert lever in line, line
    assert f"rollplex train --resume {run_dir} --set FIELD=VALUE" in line and "Traceback" not in launch.stderr
    assert_intact(run_dir)
    done = [r["iteration"] for r in metric_rows(run_dir) if r.get("phase") == "rl"]
    assert done == [0], done
    assert "prefix[model=actor]" in (run_dir / "graph.txt").read_text()

    run_to_end(run_dir, HF_TORCH + ["--set", "train.micro_batch_tokens=3"])
    rows = [r for r in metric_rows(run_dir) if r.get("phase") == "rl"]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    assert rows[1]["config_changed"] == {"train.micro_batch_tokens": [0, 3]}
    assert "config_changed" not in rows[2]
    graph = (run_dir / "graph.txt").read_text()  # the resumed run's: the loss makes the policy's forwards itself
    assert "prefix[model=actor]" not in graph and "@torch(%rollout_stats, %prompt_p0, %vis_p0" in graph, graph
