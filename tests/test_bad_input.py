"""Bad input, one table: `rollplex train` (or `graph`) must exit with code 2 and print exactly one
line, `rollplex: error: ...` naming what is wrong, with no traceback, and write nothing (no file
created, modified or removed under its working directory, run directories included).

Each case is its own process (``WarmCli``: forked from one that imported torch and transformers
once). None starts an engine: every check runs before the cluster does. Config parsing and DAG
validation are also fuzzed with hypothesis: nothing but the clear error may come out.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from dag_fixtures import CYCLIC_DAG, TWO_DEFAULTS_DAG, TWO_LOSSES_DAG
from reliability_harness import HF_TORCH, WarmCli, run_to_end


DANGLING_DAG = '''\
from rollplex import Algorithm

algorithm = Algorithm("dangling")
algorithm.policy("actor")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.advantage
def advantages(rewards):
    return rewards


@algorithm.loss
def policy_loss(logprobs, values, advantages):  # nothing produces `values`
    return -(logprobs * advantages.unsqueeze(-1))
'''

# A policy loss that takes no rollout_is_weights: train.rollout_is would have nothing to weigh.
UNWEIGHTED_DAG = DANGLING_DAG.replace('"dangling"', '"unweighted"').replace(
    "policy_loss(logprobs, values, advantages):  # nothing produces `values`", "policy_loss(logprobs, advantages):")

# Item 0 of the dataset (checked before anything is written) carries a bad image.
BAD_IMAGE = '''
import dataclasses, numpy as np
import rollplex.tasks.data as data
_item = data.SyntheticVisualTask.item
data.SyntheticVisualTask.item = lambda self, i: dataclasses.replace(_item(self, i), image={image})
'''

# W&B as it is where it was never installed.
NO_WANDB = '''
import importlib.util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "wandb" else _find(name, *a)
'''

# A pickle that would run code if anything unpickled it with full pickle.
EVIL_PICKLE = b"cos\nsystem\n(S'touch pwned'\ntR."


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    names: tuple[str, ...]  # what the one line must contain
    files: dict | None = None  # files to create first: name -> text (or a callable(cwd))
    setup: str = ""


def _corrupt(rel: str, how: str):
    def prepare(cwd: Path, finished: Path) -> None:
        shutil.copytree(finished, cwd / "run")
        target = sorted((cwd / "run" / "checkpoints").glob("iter_*"))[-1] / rel
        data = target.read_bytes()
        if how == "flip":
            target.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
        elif how == "truncate":
            target.write_bytes(data[: len(data) // 2])
        else:  # replaced by a pickle that runs code, with the manifest rewritten to match it
            import hashlib

            target.write_bytes(EVIL_PICKLE)
            manifest = target.parent / "manifest.json"
            m = json.loads(manifest.read_text())
            m["files"][rel] = {"sha256": hashlib.sha256(EVIL_PICKLE).hexdigest(), "bytes": len(EVIL_PICKLE)}
            m["sha256"] = hashlib.sha256(json.dumps(m["files"], sort_keys=True).encode()).hexdigest()
            manifest.write_text(json.dumps(m))
    return prepare


def _damage(rel: str | None, how: str = "flip"):
    """A copy of the finished run with ``rel`` (a path in it) flipped in one byte, removed, added (a
    pickle) or edited (None: a plain copy)."""
    def prepare(cwd: Path, finished: Path) -> None:
        shutil.copytree(finished, cwd / "run")
        target = cwd / "run" / (rel or "")
        if rel is None:
            return
        if how == "remove":
            target.unlink()
        elif how == "add":
            target.write_bytes(EVIL_PICKLE)
        elif how == "lr":  # an edit a person might make; YAML still parses
            target.write_text(target.read_text().replace("lr: 0.001", "lr: 0.002"))
        else:
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
    return prepare


def _model(edit):
    def prepare(cwd: Path, finished: Path) -> None:
        from rollplex.engines.models import ensure_tiny_vlm
        from rollplex.tasks.data import default_model_spec

        shutil.copytree(ensure_tiny_vlm(default_model_spec()), cwd / "model")
        config = json.loads((cwd / "model" / "config.json").read_text())
        edit(config)
        (cwd / "model" / "config.json").write_text(json.dumps(config))
    return prepare


def _heads(c):
    c["text_config"]["num_attention_heads"], c["text_config"]["num_key_value_heads"] = 8, 2  # head_dim 16


def _llama(c):
    c["architectures"], c["model_type"] = ["LlamaForCausalLM"], "llama"


TRAIN = ("train", "--out", "run")
RESUME = ("train", "--resume", "--out", "run")
CASES = {
    "malformed yaml": Case(("train", "bad.yaml", "--out", "run"), ("bad.yaml", "malformed YAML at line 3"),
                           {"bad.yaml": "rollout:\n  temperature: [1\nseed: 3\n"}),
    "unknown field": Case((*TRAIN, "--set", "rollout.temprature=0.5"),
                          ("rollout.temprature", "did you mean 'temperature'?")),
    "out of range": Case((*TRAIN, "--set", "rollout.top_p=2"), ("rollout.top_p", "above the maximum 1.0")),
    "unknown engine": Case((*TRAIN, "--set", "engines.decode=nope"), ("engines.decode", "'nope'", "vllm")),
    "unknown node kind": Case((*TRAIN, "--set", "engines.overrides={frobnicate: hf}"),
                              ("engines.overrides.frobnicate", "frobnicate")),
    "cyclic dag": Case(("train", "cyclic.py", "--out", "run"), ("cyclic.py", "cycle", "%bonus_p0", "%penalty_p0"),
                       {"cyclic.py": CYCLIC_DAG}),
    "dangling dag": Case(("train", "dangling.py", "--out", "run"), ("dangling.py", "'values'", "nothing produces"),
                         {"dangling.py": DANGLING_DAG}),
    "two defaults for one hyperparameter": Case(
        ("graph", "kl.py", "--out", "graph.html"),
        ("kl.py: algorithm 'two_defaults': hyperparameter 'kl_coef' has two defaults", "0.1 in advantages() at kl.py:",
         "0.01 in policy_loss() at kl.py:", "same default"), {"kl.py": TWO_DEFAULTS_DAG}),
    "two losses for one model": Case(
        ("graph", "losses.py", "--out", "graph.html"),
        ("losses.py: algorithm 'two_losses': model 'actor' has two losses", "policy_loss() at losses.py:",
         "entropy_bonus() at losses.py:", "keep one"), {"losses.py": TWO_LOSSES_DAG}),
    "memory budget": Case((*TRAIN, "--set", "cluster.memory_budget_gib=0.01"),
                          ("cluster.memory_budget_gib", "decode KV pool", "the budget is 0.01 GiB")),
    "corrupt checkpoint": Case(RESUME, ("model.safetensors", "fails its checksum", "iter_000005"),
                               {"run": _corrupt("model.safetensors", "flip")}),
    "truncated checkpoint": Case(RESUME, ("optimizer.pt", "truncated"), {"run": _corrupt("optimizer.pt", "truncate")}),
    "checkpoint with a foreign pickle": Case(RESUME, ("rng.pt cannot be read", "UnpicklingError"),
                                             {"run": _corrupt("rng.pt", "pickle")}),
    "checkpoint without its manifest": Case(RESUME, ("iter_000005 has no manifest.json", "resume from iter_000004"),
                                            {"run": _damage("checkpoints/iter_000005/manifest.json", "remove")}),
    "warm-up checkpoint without its manifest": Case(
        RESUME, ("after_warmup has no manifest.json", "resume from iter_000005"),
        {"run": _damage("checkpoints/after_warmup/manifest.json", "remove")}),
    "a file its manifest does not list": Case(RESUME, ("iter_000005: extra.pt is not in manifest.json",),
                                              {"run": _damage("checkpoints/iter_000005/extra.pt", "add")}),
    "a file the reference's manifest does not list": Case(
        RESUME, ("reference model", "extra.pt is not in manifest.json"), {"run": _damage("reference/extra.pt", "add")}),
    "corrupt reference": Case(RESUME, ("reference model", "model.safetensors fails its checksum"),
                              {"run": _damage("reference/model.safetensors")}),
    "reference without its manifest": Case(RESUME, ("reference model", "has no manifest.json"),
                                           {"run": _damage("reference/manifest.json", "remove")}),
    "edited config.yaml": Case(RESUME, ("run/config.yaml fails its checksum",), {"run": _damage("config.yaml", "lr")}),
    "missing config.yaml": Case(RESUME, ("run/config.yaml is missing",), {"run": _damage("config.yaml", "remove")}),
    "metrics.jsonl rewritten": Case(RESUME, ("metrics.jsonl", "up to iter_000005"), {"run": _damage("metrics.jsonl")}),
    "resume with a new learning rate": Case((*RESUME, "--set", "train.lr=0.1"),
                                            ("--resume: train.lr (0.001 → 0.1)", "start a new run"),
                                            {"run": _damage(None)}),
    "resume with a new group size": Case((*RESUME, "--set", "rollout.samples_per_prompt=4"),
                                         ("rollout.samples_per_prompt (2 → 4)",), {"run": _damage(None)}),
    "image of a wrong type": Case((*TRAIN, *HF_TORCH), ("prompt syn-000000 image 0", "got str"),
                                  setup=BAD_IMAGE.format(image="'cat.png'")),
    "image of a wrong shape": Case((*TRAIN, *HF_TORCH), ("prompt syn-000000", "uint8 HxWx3", "(56, 56)"),
                                   setup=BAD_IMAGE.format(image="np.zeros((56, 56), np.uint8)")),
    "empty dataset": Case((*TRAIN, "--set", "task.size=0"), ("task.size", "below the minimum 1")),
    "dataset smaller than a batch": Case((*TRAIN, "--set", "task.size=4"), ("task.size (4)", "prompts_per_iteration")),
    "unservable head_dim": Case((*TRAIN, "--set", "model.path=model"), ("head_dim 16", "vLLM", "engines.decode=hf"),
                                {"model": _model(_heads)}),
    "micro-batches not split evenly over ranks": Case((*TRAIN, "--workers", "2", "--set", "train.micro_batch_groups=3"),
                                                      ("train.micro_batch_groups (3)", "prompts per rank (4)")),
    "prompts not split evenly over ranks": Case((*TRAIN, "--workers", "3"),
                                                ("rollout.prompts_per_iteration (8)", "cluster.workers (3)")),
    "mini-batches that do not split the batch": Case((*TRAIN, "--set", "train.mini_batches=3"),
                                                     ("train.mini_batches: 3", "rollout.prompts_per_iteration (8)")),
    "mini-batches not split evenly over ranks": Case((*TRAIN, "--workers", "2", "--set", "train.mini_batches=8"),
                                                     ("train.mini_batches (8)", "prompts per rank (4)")),
    "dual clip of a loss without one": Case((*TRAIN, "--set", "algorithm=rloo", "--set", "train.clip_ratio_c=3"),
                                            ("train.clip_ratio_c", "rloo", "no dual clip")),
    "dual clip not above 1": Case((*TRAIN, "--set", "train.clip_ratio_c=1"), ("train.clip_ratio_c: 1.0", "above 1")),
    "dual clip set twice": Case((*TRAIN, "--set", "train.clip_ratio_c=3", "--set", "params.clip_ratio_c=2"),
                                ("train.clip_ratio_c and params.clip_ratio_c",)),
    "rollout IS cap below 1": Case((*TRAIN, "--set", "train.rollout_is.cap=0.5"), ("train.rollout_is.cap", "≥ 1")),
    "rollout IS option unknown": Case((*TRAIN, "--set", "train.rollout_is.level=token"),
                                      ("train.rollout_is", "'level'", "{cap: C}")),
    "rollout IS for a loss without its weights": Case(("train", "unweighted.py", "--out", "run", "--set",
                                                       "train.rollout_is.cap=2"),
                                                      ("train.rollout_is", "policy_loss()", "rollout_is_weights"),
                                                      {"unweighted.py": UNWEIGHTED_DAG}),
    "one sample per prompt under grpo": Case((*TRAIN, "--set", "rollout.samples_per_prompt=1"),
                                              ("rollout.samples_per_prompt: 1", "grpo", "advantages()",
                                               "at least 2 samples")),
    "one sample per prompt under dapo": Case((*TRAIN, "--set", "algorithm=dapo", "--set",
                                              "rollout.samples_per_prompt=1"),
                                             ("rollout.samples_per_prompt: 1", "dapo", "at least 2 samples")),
    "resume and out naming two run directories": Case(("train", "--resume", "run", "--out", "other"),
                                                      ("--resume run and --out other", "two run directories")),
    "resume given a config file": Case(("train", "--resume", "my.yaml", "--out", "run"),
                                       ("--resume my.yaml: a file, not a run directory",
                                        "rollplex train my.yaml --resume RUN_DIR"), {"my.yaml": "seed: 1\n"}),
    "validation on a file without a val file": Case((*TRAIN, "--set", "data.path=train.jsonl", "--set", "eval.every=5"),
                                                    ("eval.every", "data.val_path"),
                                                    {"train.jsonl": '{"prompt": "hi", "answer": "a"}\n'}),
    "greedy validation with several samples": Case((*TRAIN, "--set", "eval.every=1", "--set", "eval.samples=4"),
                                                   ("eval.samples: 4 greedy responses", "eval.temperature")),
    "a val file that does not exist": Case((*TRAIN, "--set", "eval.every=1", "--set", "data.val_path=val.jsonl"),
                                           ("data.val_path", "val.jsonl does not exist")),
    "a val row longer than the training prompts": Case(
        (*TRAIN, *HF_TORCH, "--set", "eval.every=1", "--set", "data.val_path=val.jsonl"),
        ("val.jsonl line 1", "more than data.max_prompt_tokens"),
        {"val.jsonl": json.dumps({"prompt": "What colour " * 40, "answer": "red"}) + "\n"}),
    "an unknown logging backend": Case((*TRAIN, "--set", "logging.backends=[jsonl, mlflow]"),
                                       ("logging.backends", "'mlflow'", "tensorboard, wandb")),
    "a logging backend not installed": Case((*TRAIN, "--set", "logging.backends=[wandb]"),
                                            ("logging.backends: wandb needs the wandb package", "pip install wandb"),
                                            setup=NO_WANDB),
    "unservable architecture": Case((*TRAIN, "--set", "model.path=model", *HF_TORCH),
                                    ("LlamaForCausalLM", "Qwen2.5-VL"), {"model": _model(_llama)}),
    # -- command-line arguments: argparse's errors are one line too
    "a flag of the wrong type": Case((*TRAIN, "--iterations", "abc"),
                                     ("argument --iterations: invalid int value: 'abc'", "rollplex train --help")),
    "an unknown flag": Case((*TRAIN, "--iteratons", "3"), ("unrecognized arguments: --iteratons",)),
    "an unknown command": Case(("trian",), ("invalid choice: 'trian'", "rollplex --help")),
    # -- addresses and paths: the wrong kind of thing
    "scheduler that is not an address": Case((*TRAIN, "--scheduler", "notaurl"),
                                             ("cluster.scheduler", "'notaurl' is not a Dask address")),
    "scheduler without a port": Case((*TRAIN, "--scheduler", "tcp://127.0.0.1"), ("cluster.scheduler", "HOST:PORT")),
    "scheduler port out of range": Case((*TRAIN, "--scheduler", "tcp://127.0.0.1:99999"), ("port 99999",)),
    "--out names a file": Case(("train", "--out", "f.txt"), ("--out f.txt: is a file",), {"f.txt": "x"}),
    "--out inside a file": Case(("train", "--out", "f.txt/run"), ("f.txt is a file",), {"f.txt": "x"}),
    "--out on a read-only file system": Case(
        ("train", "--out", "ro/run"), ("--out ro/run: ro is not writable", "read-only"), {"ro/keep": "x"},
        # what os.access says of a read-only mount (EROFS), whoever the user is
        setup="import os; _access = os.access; os.access = lambda p, m, **k: False if str(p) == 'ro' else "
              "_access(p, m, **k)"),
    "graph --out names a directory": Case(("graph", "--out", "outdir"), ("--out outdir: is a directory",),
                                          {"outdir/keep": "x"}),
    "DAG path names a directory": Case((*TRAIN, "--set", "algorithm=sub/"), ("DAG file sub is a directory",),
                                       {"sub/keep": "x"}),
    "reward path names a directory": Case((*TRAIN, "--set", "task.reward=r.py:fn"), ("r.py is a directory",),
                                          {"r.py/keep": "x"}),
    "an empty model.path": Case((*TRAIN, "--set", "model.path="), ("model.path: is empty",)),
    "an empty data.path in a config file": Case(("train", "c.yaml", "--out", "run"), ("data.path: is empty",),
                                                {"c.yaml": 'data:\n  path: ""\n'}),
    "model.path names a file": Case((*TRAIN, "--set", "model.path=m"), ("model.path: m is a file",), {"m": "x"}),
    "TLS file names a directory": Case((*TRAIN, "--scheduler", "tls://127.0.0.1:1", "--set", "cluster.tls_ca_file=t",
                                        "--set", "cluster.tls_cert=t", "--set", "cluster.tls_key=t"),
                                       ("cluster.tls_ca_file: t is not a file",), {"t/keep": "x"}),
    "config file names a directory": Case(("train", "c.yaml", "--out", "run"), ("c.yaml is a directory",),
                                          {"c.yaml/keep": "x"}),
    # -- option dicts and hyperparameters: the engines' own ranges, unknown keys refused
    "train option that a train field sets": Case((*TRAIN, "--set", "engines.train_options={lr: abc}"),
                                                 ("engines.train_options.lr: set train.lr instead",)),
    "unknown decode option": Case((*TRAIN, "--set", "engines.decode_options={nope: 1}"),
                                  ("engines.decode_options.nope", "takes no option", "max_num_seqs")),
    "decode option of a wrong type": Case((*TRAIN, *HF_TORCH, "--set", "engines.decode_options={max_num_seqs: many}"),
                                          ("engines.decode_options.max_num_seqs: expected int",)),
    "unknown vLLM engine argument": Case((*TRAIN, "--set", "engines.decode_options={vllm_kwargs: {blok_size: 32}}"),
                                         ("engines.decode_options.vllm_kwargs", "'blok_size'")),
    "vLLM engine argument of a wrong type": Case(
        (*TRAIN, "--set", "engines.decode_options={vllm_kwargs: {block_size: abc}}"),
        ("engines.decode_options.vllm_kwargs: block_size", "'abc'")),
    "vLLM engine argument out of vLLM's range": Case(
        (*TRAIN, "--set", "engines.decode_options={vllm_kwargs: {gpu_memory_utilization: 5}}"),
        ("vllm_kwargs: gpu_memory_utilization: vLLM's CacheConfig refuses 5",)),
    "vLLM engine argument that Rollplex sets": Case(
        (*TRAIN, "--set", "engines.decode_options={vllm_kwargs: {logprobs_mode: raw_logprobs}}"),
        ("vllm_kwargs: logprobs_mode: Rollplex sets it",)),
    "max_model_len shorter than a sequence": Case((*TRAIN, "--set", "engines.decode_options={max_model_len: 10}"),
                                                  ("engines.decode_options.max_model_len: 10 is shorter",)),
    "responses past the model's positions": Case((*TRAIN, "--set", "rollout.max_new_tokens=60000",
                                                  "--set", "rollout.chunk_tokens=60000"),
                                                 ("rollout.max_new_tokens", "max_position_embeddings (2048)")),
    "hyperparameter of a wrong type": Case((*TRAIN, "--set", "params.kl_coef=abc"),
                                           ("params.kl_coef: expected float", "'abc'")),
    "hyperparameter that is nan": Case((*TRAIN, "--set", "params.kl_coef=.nan"), ("params.kl_coef", "finite")),
    "top_p of 0": Case((*TRAIN, "--set", "rollout.top_p=0"), ("rollout.top_p: 0.0 is not above 0.0",)),
    "infinite gradient clip": Case((*TRAIN, "--set", "train.grad_clip=.inf"), ("train.grad_clip", "maximum")),
    "infinite reference cache": Case((*TRAIN, "--set", "train.ref_cache_gib=.inf"), ("train.ref_cache_gib",)),
    "a task too large to shuffle": Case((*TRAIN, "--set", "task.size=1000000000000000"), ("task.size", "maximum")),
    "a warm-up batch too large to build": Case((*TRAIN, "--set", "warmup.batch_size=100000000000"),
                                               ("warmup.batch_size", "maximum")),
    "W&B online without an API key": Case(
        (*TRAIN, "--set", "logging.backends=[jsonl, wandb]"), ("logging.backends: wandb cannot log in", "WANDB_MODE"),
        # no key in the environment or a netrc, whatever this machine has
        setup="import os; [os.environ.pop(k) for k in list(os.environ) if k.startswith('WANDB_')]; "
              "os.environ['NETRC'] = os.path.join(os.getcwd(), 'no-netrc')"),
    # -- YAML that could mean two things
    "a key twice": Case(("train", "c.yaml", "--out", "run"),
                        ("c.yaml: ambiguous YAML at line 2", "'seed' appears twice"), {"c.yaml": "seed: 1\nseed: 2\n"}),
    "yes for a bool": Case(("train", "c.yaml", "--out", "run"), ("c.yaml: ambiguous YAML", "yes is true in YAML 1.1"),
                           {"c.yaml": "cluster:\n  processes: yes\n"}),
    "a leading-zero number": Case(("train", "c.yaml", "--out", "run"), ("010 is 8 in YAML 1.1 and 10 in YAML 1.2",),
                                  {"c.yaml": "seed: 010\n"}),
    "on in --set": Case((*TRAIN, "--set", "cluster.dashboard=on"), ("--set 'cluster.dashboard=on'", "YAML 1.1")),
}


@pytest.fixture(scope="module")
def cli():
    return WarmCli()  # its server stops with this process


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A complete tiny run whose checkpoints (all kept, the warm-up's included) the checkpoint cases
    damage (in a copy)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_to_end(run_dir, [*HF_TORCH, "--set", "checkpoint.keep_last=10"])
    return run_dir


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, cli, tmp_path, request):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name, content in (case.files or {}).items():
        if callable(content):
            content(cwd, request.getfixturevalue("finished_run"))
        else:
            (cwd / name).parent.mkdir(parents=True, exist_ok=True)
            (cwd / name).write_text(content)
    result = cli(cwd, list(case.argv), case.setup)
    assert result.rc == 2, (result.rc, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollplex: error: "), result.stderr
    for name in case.names:
        assert name in lines[0], f"{name!r} not in: {lines[0]}"
    assert result.changed == [], f"bad input changed {result.changed}"
    assert not (cwd / "pwned").exists()


def test_an_out_on_a_read_only_mount_is_refused(tmp_path):
    """The table's read-only case stands in for what os.access says of one; this one mounts a read-only
    tmpfs, in a user and mount namespace of its own so that it needs no privilege and leaves no mount."""
    import subprocess
    import sys

    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)  # user namespaces, unshare(1)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged mount namespace here: {probe.stderr.decode().strip()}")
    (tmp_path / "ro").mkdir()
    result = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro,size=1m tmpfs ro && exec "$0" "$@"',
                             sys.executable, "-m", "rollplex.cli", "train", "--out", "ro/run"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (
        2, "rollplex: error: --out ro/run: ro is not writable (a read-only file system, or no permission)\n")
    assert [p.name for p in tmp_path.rglob("*")] == ["ro"]


USER_LOSS = '''\
from rollplex import Algorithm

algorithm = Algorithm("user")
algorithm.policy("actor")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.advantage(scope="group")
def advantages(rewards):
    return rewards - rewards.mean()


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, advantages):
    return {loss}
'''
USER_CODE = {
    "a loss of the wrong shape": (USER_LOSS.format(loss="-(logprobs.sum(-1) * advantages)"), [],
                                  ("policy_loss() at user.py:13 returned a torch.float32 tensor of shape [2]",
                                   "shaped like mask [2, 2]")),
    "a loss that is not a tensor": (USER_LOSS.format(loss="0.5"), [],
                                    ("policy_loss() at user.py:13 returned float 0.5",)),
    "a loss that raises": (USER_LOSS.format(loss="-(logprobs * advantages[1000])"), [],
                           ("user.py:15 in policy_loss() raised IndexError: index 1000 is out of bounds",)),
    "a reward that returns None": ("def bad(text, answer):\n    return None\n", ["--set", "task.reward=user.py:bad"],
                                   ("%reward_p0 (reward): bad() at user.py:1 returned NoneType None",)),
}


@pytest.mark.parametrize("case", list(USER_CODE), ids=list(USER_CODE))
def test_an_error_in_user_code_is_one_line_naming_node_file_and_line(case, cli, tmp_path):
    """Known only once the code runs: one line naming the iteration, the node and the user's file and
    line (exit 2), the traceback in the run directory's errors.log."""
    from reliability_harness import TINY

    source, extra, names = USER_CODE[case]
    (tmp_path / "user.py").write_text(source)
    dag = ["user.py"] if "Algorithm" in source else []
    result = cli(tmp_path, ["train", *dag, "--out", "run", *TINY, *HF_TORCH, "--iterations", "1",
                            "--set", "warmup.steps=0", *extra])
    assert result.rc == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollplex: error: iteration 0: %"), result.stderr[-2000:]
    assert lines[0].endswith("(traceback in run/errors.log)") and "Traceback" not in result.stderr, lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not in: {lines[0]}"
    log = (tmp_path / "run" / "errors.log").read_text()
    said = lines[0].removeprefix("rollplex: error: ").removesuffix(" (traceback in run/errors.log)")
    assert "Traceback (most recent call last)" in log and said in log, log


def read_on_resume(run: Path) -> list[str]:
    """Every file of a run directory that `rollplex train --resume` reads: the newest checkpoint's,
    the state.json (and manifest) of the older ones, the warm-up's included (retention), the reference,
    config.yaml and the metrics it keeps. Rollouts, traces and graph.txt are written, never read."""
    from rollplex.pipeline.run.checkpoints import final_dirs

    *older, newest = final_dirs(run / "checkpoints")
    files = [p for p in newest.rglob("*") if p.is_file()] + [p for p in (run / "reference").rglob("*") if p.is_file()]
    files += [d / name for d in older for name in ("state.json", "manifest.json")]
    return sorted(p.relative_to(run).as_posix() for p in files + [run / "config.yaml", run / "metrics.jsonl"])


def test_a_flipped_byte_in_any_file_a_resume_reads_is_refused_naming_it(cli, finished_run, tmp_path):
    files = read_on_resume(finished_run)
    assert len(files) >= 20 and {"reference/model.safetensors", "checkpoints/after_warmup/state.json"} <= set(files)
    wrong = []
    for i, rel in enumerate(files):
        cwd = tmp_path / f"case{i}"
        cwd.mkdir()
        _damage(rel)(cwd, finished_run)
        result = cli(cwd, list(RESUME))
        lines = result.stderr.splitlines()
        named = rel if rel in ("config.yaml", "metrics.jsonl") else Path(rel).name
        if not (result.rc == 2 and len(lines) == 1 and lines[0].startswith("rollplex: error: ")
                and named in lines[0] and result.changed == []):
            wrong.append((rel, result.rc, result.stderr[-300:], result.changed[:3]))
    assert not wrong, wrong


# -- fuzzing ------------------------------------------------------------------------------------------
VALUES = ["rewards", "responses", "mask", "advantages", "logprobs", "old_logprobs", "ref_logprobs", "bonus", "extra",
          "values", "penalty"]
names = st.sampled_from(VALUES)


@st.composite
def algorithms(draw):
    """An Algorithm built through the public API with random models, scores and functions reading
    random values: sometimes valid, often not."""
    from rollplex import Algorithm

    alg = Algorithm("fuzz")
    models = draw(st.lists(st.sampled_from(["actor", "ref", "critic"]), max_size=3, unique=True))
    for i, m in enumerate(models):
        if i == 0:
            alg.policy(m)
        else:  # one policy; other models trained (a critic) or frozen
            declare = alg.critic if draw(st.booleans()) else alg.frozen
            declare(m, copy_of=draw(st.sampled_from(models + ["nobody"])))
    for _ in range(draw(st.integers(0, 3))):
        alg.score(draw(st.sampled_from(models + ["ghost"])), as_=draw(st.sampled_from(["logprobs", "ref_logprobs",
                                                                                      "values"])),
                  grad=draw(st.booleans()))

    def fn(params):  # a named function, as in a DAG file (node names come from function names)
        scope: dict = {}
        exec(f"def f{draw(st.integers(0, 99))}({', '.join(params)}):\n    return 0", scope)  # noqa: S102
        return next(v for k, v in scope.items() if k.startswith("f"))

    for _ in range(draw(st.integers(0, 3))):
        alg.node(fn(draw(st.lists(names, max_size=3, unique=True))), writes=draw(st.sampled_from(["bonus", "extra",
                                                                                                  "penalty"])),
                 per=draw(st.sampled_from(["prompt", "batch"])))
    if draw(st.booleans()):
        alg.advantage(fn(draw(st.lists(names, min_size=1, max_size=3, unique=True))),
                      scope=draw(st.sampled_from(["group", "batch"])))
    if draw(st.booleans()):
        alg.loss(fn(draw(st.lists(names, min_size=1, max_size=4, unique=True))),
                 agg=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])))
    return alg


def _build(draw_alg):
    from rollplex.errors import RollplexError

    try:
        return draw_alg()
    except RollplexError:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), prompts=st.integers(1, 4), samples=st.integers(1, 3), micro=st.integers(1, 4))
def test_random_user_dags_compile_or_fail_with_a_graph_error(data, prompts, samples, micro):
    from rollplex.errors import RollplexError
    from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
    from rollplex.pipeline.plan.schedule import schedule

    alg = _build(lambda: data.draw(algorithms()))
    if alg is None:  # a declaration refused at once (twice-declared model, ...) is a clear error too
        return
    dims = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=600, params=600_000)
    try:
        alg.validate()
        graph = compile_iteration(alg, BatchShape(prompts=prompts, samples=samples, max_new_tokens=4, chunk_tokens=2,
                                                  micro_batch_groups=micro),
                                  EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"}),
                                  dims)
        graph.lint()
        schedule(graph, data.draw(st.sampled_from(["serial", "rollplex"])))
    except RollplexError as exc:
        assert "\n" not in str(exc) and str(exc), repr(exc)


OVERRIDE_KEYS = st.sampled_from(["seed", "iterations", "cluster.tls_ca_file", "cluster.tls_cert", "cluster.scheduler",
                                 "cluster.memory_budget_gib", "task.size", "rollout.prompts_per_iteration",
                                 "rollout.chunk_tokens", "rollout.max_new_tokens", "checkpoint.every", "params.x",
                                 "engines.overrides", "task.kinds"])
OVERRIDE_VALUES = st.one_of(st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=12),
                            st.sampled_from(["null", "tls://h:1", "[]", "{a: 1}", "/nonexistent", "1e400"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES), max_size=5))
def test_random_overrides_of_the_reliability_fields_raise_only_config_error(overrides):
    from rollplex.config import load_config
    from rollplex.errors import ConfigError

    try:
        load_config(None, [f"{k}={v}" for k, v in overrides])
    except ConfigError as exc:
        assert "\n" not in str(exc), repr(exc)
