"""The training loop: compile once, then run iterations on Dask and write the run directory.

Run directory layout:
    config.yaml                 the resolved config
    metrics.jsonl               one JSON object per iteration ("phase": "warmup", "rl" or "eval")
    rollouts/iter_NNNNNN.jsonl  one object per response
    eval/iter_NNNNNN.jsonl      validation responses of the policy that samples iteration N (eval.*)
    tensorboard/, wandb_id      the loggers' own files (logging.backends)
    traces/iter_NNNNNN.json     Chrome trace events, one track per worker and stream (Perfetto)
    checkpoints/iter_NNNNNN/    the actor in HF format + optimizer, RNG and data-loader state
    checkpoints/after_warmup/   the same after the warm-up, before RL iteration 0 (when there is one)
    reference/                  the warmed-up policy, the reference (after a warm-up; else model.path)
    errors.log                  the traceback of each error in the user's code (the console has one line)
Every model folder holds the processor files too, so it loads alone in transformers.
Every file is written atomically (temp file + rename); ``--resume`` continues from the last
complete checkpoint and truncates later metric rows, so the sequence has no gaps or duplicates.
A lost Dask worker rolls the run back to its last checkpoint and replays from there, and
SIGINT/SIGTERM stop it after the iteration in flight with a checkpoint (``pipeline/run/recovery.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollplex.config import MAY_CHANGE_ON_RESUME, RunConfig, config_changes, resolve_task_defaults, run_config_text
from rollplex.errors import (CheckpointError, ConfigError, DeviceMemoryError, Interrupted, NodeFailure,
                             NonFiniteError, RollplexError, UserCodeError, WorkerLost)
from rollplex.pipeline.run import checkpoints
from rollplex.pipeline.run.faults import point
from rollplex.fsio import append_line, atomic_write_text
from rollplex.pipeline.run import evaluation
from rollplex.pipeline.run.hostops import _adopt_reference, _end_warmup, _lora_sizes, _restore, _sync_decode, _warmup
from rollplex.pipeline.run.loggers import WANDB_ID, Loggers, check_installed
from rollplex.pipeline.run.session import Session, resolve_device
from rollplex.pipeline.plan.autoschedule import DROPPED_FILE
from rollplex.pipeline.plan.trace import chrome_trace, seconds_by_kind


MOVING_WINDOW = 10  # iterations averaged for stop_at_reward and the summary's final reward
ERRORS_LOG = "errors.log"  # tracebacks of errors in the user's code, which the console gets as one line


@dataclass
class RunSummary:
    run_dir: Path
    iterations: int
    final_reward: float
    seconds_per_iteration: float


def write_iteration_files(run_dir: Path, iteration: int, rows: list[dict], trace: dict) -> None:
    atomic_write_text(run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl",
                      "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    atomic_write_text(run_dir / "traces" / f"iter_{iteration:06d}.json", json.dumps(trace))


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
          log=print) -> RunSummary:
    import contextlib

    import dask

    from rollplex import runtime
    from rollplex.pipeline.run import faults
    from rollplex.pipeline.run.cluster import connect, install_engines, uninstall_engines
    from rollplex.pipeline.run.recovery import StopSignals, children_ignore_sigint, quiet_task_errors

    cfg = resolve_task_defaults(cfg)  # warm-up and reward stop: the embedded task's, unless asked for
    check_installed(cfg.logging.backends)
    runtime.configure(threads=cfg.cluster.threads, device=resolve_device(cfg))
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    state = None
    metrics_path = run_dir / checkpoints.METRICS
    if resume:
        state = checkpoints.latest(run_dir)  # verified; a corrupt one is refused here
        if state is None:  # killed before the first checkpoint: nothing to keep, start again
            log(f"--resume: {run_dir} has no complete checkpoint yet; starting the run from the beginning")
    elif metrics_path.exists():
        raise RollplexError(f"{run_dir} already holds a run; pass --resume to continue it or pick another --out")
    else:  # schedule auto's candidates that an earlier start dropped before it logged a row: not this run's
        (run_dir / DROPPED_FILE).unlink(missing_ok=True)
    changed: dict = {}
    if state is not None:  # what else the resume reads, checked before anything starts
        changed = resume_changes(cfg, state, log)
        checkpoints.kept_metrics(metrics_path, state.iteration, state.metrics_sha256, state.directory.name)
        checkpoints.verify_side_files(run_dir, state, {WANDB_ID} if "wandb" in cfg.logging.backends else set())
        checkpoints.verify_states(run_dir)
        if (run_dir / checkpoints.REFERENCE).exists():
            checkpoints.verify_reference(run_dir)
    session = Session(cfg, run_dir)
    session.loader.log = log
    for bad in getattr(session.task, "bad_rows", [])[:20]:
        log(f"data: skipped a bad row: {bad}")
    if len(getattr(session.task, "bad_rows", [])) > 20:
        log(f"data: ... {len(session.task.bad_rows) - 20} more bad rows skipped (data_skipped_rows in metrics.jsonl)")
    if state is not None:
        session.loader.load_state_dict(state.loader)  # refuses a checkpoint of another task or seed
        if cfg.warmup.steps and session.reference_path == session.model_path:
            raise RollplexError(f"--resume: {run_dir / 'reference'} (the warmed-up reference model) is missing")
    else:
        session.reference_path = session.model_path  # a killed attempt's reference is rebuilt by warm-up
    spec = session.host_spec()
    if session.memory_plan is not None:
        log(session.memory_plan.describe())
    elif cfg.cluster.memory_budget_gib is not None:  # without a plan, everything stays resident
        from rollplex.pipeline.run import preflight
        from rollplex.pipeline.run.worker import shares_policy_base

        # LoRA's reference is the policy's base: not a copy.
        alg = session.algorithm
        copies = [m for m in spec.frozen if not (cfg.train.lora is not None and m in alg.models
                                                 and shares_policy_base(alg.models[m], alg.rollout_model))]
        preflight.check_memory_budget(cfg.cluster.memory_budget_gib, preflight.memory_terms(
            *preflight.parameter_counts(session.model_path, cfg.train.freeze_vision, cfg.train.lora),
            4 if cfg.model.dtype == "float32" else 2,
            session.train_engine, len(copies), spec.decode_options.get("kv_cache_bytes", 0),
            None if session.weight_plan is None else session.weight_plan.per_gpu("extra")))
    where = session.device if session.worker_processes else f"{session.device} (in-process worker)"
    log(f"rollplex: {session.algorithm.name} on {where}, schedule={cfg.schedule}, "
        f"engines decode={session.decode_engine} train={session.train_engine} score={session.score_engine}, "
        f"{len(session.graph)} nodes/iteration → {run_dir}")
    if session.weight_plan is not None:  # engines.weight_sharing
        plan = session.weight_plan
        log(f"weight sharing: the decode engine runs on the trainer's weights ({plan.per_gpu('aliased') / 2**20:.1f} "
            f"MiB as views, {plan.per_gpu('extra') / 2**20:.1f} MiB rebuilt)")
    elif cfg.engines.weight_sharing != "off":  # asked for, but these engines cannot (ZeRO-3, say): say why
        from rollplex.pipeline.plan.weightshare import sharing_refusal

        why = sharing_refusal(session.decode_engine, session.train_engine, cfg.train.zero_stage,
                              cfg.train.lora is not None)
        log(f"weight sharing off: {why}")
    if session.train_fusion_off:  # asked for, but this algorithm or shape cannot: say why
        log(f"train fusion off: {session.train_fusion_off}; the policy trains after decode")
    if session.fusion_cap_unused:
        log("train.fusion_batch_tokens has no effect: it caps train fusion's backwards, and no schedule of this "
            "run trains in the decode window")
    if session.ref_cache_off:
        log(f"reference-prefix cache off: {session.ref_cache_off}")
    stop = StopSignals()
    with contextlib.ExitStack() as stack:
        # A task on a dead worker fails at once (KilledWorker) instead of being re-run on a fresh
        # worker's engines; the runner replays it from a checkpoint (LocalCluster only: an external
        # scheduler keeps its own setting, and WorkerWatch catches the re-run instead).
        stack.enter_context(dask.config.set({"distributed.scheduler.allowed-failures": 0}))
        with children_ignore_sigint():
            client = stack.enter_context(connect(cfg.cluster.scheduler, cfg.cluster.workers, cfg.cluster.threads,
                                                 session.worker_processes, cfg.cluster.dashboard,
                                                 security=cluster_security(cfg)))
        stop.install()
        stack.callback(stop.uninstall)
        t0 = time.time()
        if cfg.cluster.dashboard:
            log(f"Dask dashboard: {dashboard_link(client)}")
        install_engines(client, spec)
        ranks = None
        if session.world > 1:
            from rollplex.pipeline.run.cluster import form_ranks

            ranks = form_ranks(client, spec, session.world)
            log(f"{session.world} data-parallel ranks: {', '.join(ranks)}")
            if spec.tp_rollout > 1:
                from rollplex.pipeline.run.worker import decode_tensor_parallel

                shares = client.run(decode_tensor_parallel)
                log("decode tensor parallel: " + ", ".join(
                    f"rank{r} {shares[a][0] + 1}/{shares[a][1]}" for r, a in enumerate(ranks)))
        client.run(quiet_task_errors)
        if faults.active():
            client.run(faults.install_task_hooks)
        # Written only now: bad input (config, DAG, engines, cluster) fails above with nothing on disk.
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoints.clean_stale(run_dir)
        checkpoints.retain(run_dir, cfg.checkpoint.keep_last)
        atomic_write_text(run_dir / "config.yaml", run_config_text(cfg))
        atomic_write_text(run_dir / "graph.txt", str(session.graph) + "\n")
        try:
            return _train_loop(cfg, session, client, state, metrics_path, progress, log, t0, stop, ranks, changed)
        finally:
            if cfg.cluster.scheduler:
                uninstall_engines(client)


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that cannot be one before anything starts: a file, or a place where it
    cannot be written (a read-only file system, no permission). Creates nothing."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir}: is a file, not a run directory")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {run_dir}: {existing} is a file, so the run directory cannot be made in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {run_dir}: {existing} is not writable (a read-only file system, or no permission)")


def resume_changes(cfg: RunConfig, state, log) -> dict:
    """The fields a resume changes ({field: (before, after)}) against the config its checkpoint
    recorded: refused by name where they define the run (``MAY_CHANGE_ON_RESUME``), else logged."""
    if state.config is None:
        raise CheckpointError(f"checkpoint {state.directory} records no config (an earlier Rollplex wrote it), so a "
                              "resume cannot check it continues the same run; start the run again")
    changed = config_changes(state.config, cfg.to_dict())
    defining = {k: v for k, v in changed.items() if k not in MAY_CHANGE_ON_RESUME}
    if defining:
        shown = ", ".join(f"{k} ({a!r} → {b!r})" for k, (a, b) in defining.items())
        raise ConfigError(f"--resume: {shown} would change what the run computes; {state.directory.name} was "
                          f"written with the first value{'s' * (len(defining) > 1)}; start a new run (another "
                          "--out) to change it")
    for k, (a, b) in changed.items():
        log(f"--resume: {k} {a!r} → {b!r} from iteration {state.iteration + 1} (recorded in metrics.jsonl)")
    return changed


def dashboard_link(client) -> str:
    """The scheduler's dashboard address, or why there is none (it needs bokeh, an optional package)."""
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return "unavailable: `pip install bokeh` (the dashboard's optional dependency)"
    return client.dashboard_link


def cluster_security(cfg: RunConfig):
    """Dask TLS from cluster.tls_* (mutual TLS to a remote scheduler), or None."""
    c = cfg.cluster
    if not c.tls_ca_file:
        return None
    from distributed.security import Security

    return Security(tls_ca_file=c.tls_ca_file, tls_client_cert=c.tls_cert, tls_client_key=c.tls_key,
                    require_encryption=True)


def lora_line(options: dict, sizes: dict) -> str:
    """One line: the adapters, and per frozen copy of the policy the bytes of its own (measured on the
    worker's tensors) against the full copy it would be without LoRA."""
    share = sizes["adapter_params"] / max(sizes["adapter_params"] + sizes["base_params"], 1)
    line = (f"lora: rank {options['rank']}, alpha {options['alpha']:g} on {sizes['targets']} layers "
            f"({', '.join(options['target_modules'])}): {sizes['adapter_params']:,} trainable parameters ({share:.1%})")
    if not sizes["copies"]:
        return line + "; no frozen copy of the policy in this algorithm"
    full = sizes["base_bytes"]
    for model, own in sizes["copies"].items():
        line += (f"; {model} is the base with the adapters off, on the policy's weights: {own:,} bytes of its "
                 f"own, {full - own:,} bytes ({(full - own) / 2**20:.1f} MiB) saved against a copy")
    return line


def _start_from(cfg: RunConfig, session: Session, executor, watch, state, metrics_path: Path, log, stop,
                recovering: bool) -> tuple[int, list[dict]]:
    """Bring the driver (loader, RNG, metrics) and every host's engines to ``state``, a checkpoint or
    the very beginning. Returns the first iteration to run and the RL metrics rows logged before it."""
    import random

    import torch

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if state is None:
        if recovering and watch.survived:
            raise RollplexError("a Dask worker was lost before the first checkpoint while others kept their "
                                "state, so there is nothing consistent to roll back to; start the run again")
        metrics_path.unlink(missing_ok=True)
        session.loader.load_state_dict({**session.loader.state_dict(), "epoch": 0, "position": 0})
        if cfg.warmup.steps:
            _run_warmup(cfg, session, executor, metrics_path, log, stop)
            session.checkpoint(executor, checkpoints.WARMUP, reward=None, pids=set(watch.known.values()))
        return 0, []
    session.loader.load_state_dict(state.loader)
    checkpoints.restore_rng(state.rng)
    checkpoints.truncate_metrics(metrics_path, state.iteration, state.metrics_sha256, state.directory.name)
    reference = session.run_dir / checkpoints.REFERENCE
    reload = recovering and (reference / "config.json").exists()
    if reload:
        checkpoints.verify_reference(session.run_dir)
    watch.on_each(_restore, str(state.directory), str(reference) if reload else None)
    return state.iteration + 1, checkpoints.rl_rows(metrics_path)


def _failure(exc: BaseException, where: str, run_dir: Path, cfg: RunConfig) -> BaseException:
    """A NaN/Inf refusal becomes one line naming the iteration, an error in the user's code one line
    naming the iteration, node and code, its traceback appended to errors.log, and running out of
    device memory one line naming the node and what holds less; anything else stays."""
    if isinstance(exc, UserCodeError):
        log_path = run_dir / ERRORS_LOG
        append_line(log_path, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {where}: {exc}\n{exc.trace.rstrip()}")
        return UserCodeError(f"{where}: {exc} (traceback in {log_path})")
    detail = exc.detail if isinstance(exc, NodeFailure) else ""
    done = checkpoints.latest_name(run_dir)
    kept = f"the last good checkpoint, {done}, is intact" if done else "no checkpoint was written yet"
    if isinstance(exc, FloatingPointError) or detail.startswith("FloatingPointError"):
        return NonFiniteError(f"{where} stopped before its update: {exc}; nothing of it was applied or written; "
                              f"{kept} (rollplex train --resume {run_dir} continues from it)")
    from rollplex.pipeline.run.recovery import out_of_memory_text

    said = out_of_memory_text(exc)
    if said is not None:
        return _out_of_memory(cfg, exc, said, where, run_dir, kept)
    return exc


def _out_of_memory(cfg: RunConfig, exc: BaseException, said: str, where: str, run_dir: Path,
                   kept: str) -> DeviceMemoryError:
    """One line: the node that ran out, the first two sentences of what torch ``said`` (what it tried
    to allocate), and the settings not yet in use that hold less at once, with the resume that
    changes one."""
    node = f"%{exc.node} ({exc.kind})" if isinstance(exc, NodeFailure) else "a node"
    said = said.split("\n")[0].split(". ", 2)[:2]
    levers = []
    if not cfg.train.gradient_checkpointing:
        levers.append("train.gradient_checkpointing=true (recompute layers' activations in the backward)")
    if not cfg.train.micro_batch_tokens:
        levers.append("train.micro_batch_tokens=N (backwards of at most N tokens)")
    if cfg.train.train_fusion and not cfg.train.fusion_batch_tokens:
        levers.append("train.fusion_batch_tokens=N (train fusion's backwards of at most N tokens)")
    if not cfg.cluster.memory_plan:
        levers.append("cluster.memory_plan=true with cluster.memory_budget_gib (offload what the plan can move)")
    fix = (f"; less is held at once with {', or '.join(levers)}: rollplex train --resume {run_dir} --set FIELD=VALUE "
           f"continues from it" if levers else f" (rollplex train --resume {run_dir} continues from it)")
    return DeviceMemoryError(f"{where}: {node} ran out of device memory ({'. '.join(said).rstrip('.')}); nothing of "
                             f"this iteration was applied or written; {kept}{fix}")


def _train_loop(cfg: RunConfig, session: Session, client, state, metrics_path: Path, progress: bool, log,
                t0: float, stop, ranks: list[str] | None = None, changed: dict | None = None) -> RunSummary:
    """``changed``: fields this resume changed ({field: (before, after)}), recorded in the row of the
    first iteration run under them."""
    from rollplex.pipeline.run.executor import DaskExecutor
    from rollplex.pipeline.run.recovery import WorkerWatch

    run_dir = session.run_dir
    executor = DaskExecutor(client, ranks, cfg.cluster.lowering, installed=session.graphs)
    watch = WorkerWatch(client)
    log(f"engines ready in {time.time() - t0:.1f}s")
    if cfg.train.lora is not None:
        log(lora_line(cfg.train.lora, executor.call(_lora_sizes)))
    loggers = Loggers(cfg, run_dir, fresh=state is None, logged=checkpoints.metric_rows(metrics_path))
    failed = True
    try:
        summary = _iterate(cfg, session, executor, watch, loggers, state, metrics_path, progress, log, stop,
                           changed or {})
        failed = False
        return summary
    finally:
        loggers.close(failed)


def _iterate(cfg: RunConfig, session: Session, executor, watch, loggers, state, metrics_path: Path, progress: bool,
             log, stop, changed: dict) -> RunSummary:
    from tqdm import tqdm

    from rollplex.pipeline.run import faults
    from rollplex.pipeline.run.executor import task_key
    from rollplex.pipeline.run.recovery import drop_tracebacks, out_of_memory, quiet_task_errors

    run_dir, client = session.run_dir, executor.client
    changed_at = state.iteration + 1 if state else 0  # a rollback below may move ``state`` on
    validation = evaluation.Validation(cfg, session.eval_task, run_dir) if session.eval_task is not None else None

    def validate(policy: int) -> None:  # the policy that samples RL iteration `policy`
        row = validation.run(executor, policy, set(watch.known.values()))
        append_line(metrics_path, json.dumps(row, sort_keys=True))
        loggers.log(row)
        bar.write(validation.describe(row)) if progress else log(validation.describe(row))

    bar, trying = None, None  # trying: schedule auto's candidate of the iteration in flight, still timed
    iteration_seconds: list[float] = []
    iteration, recovering, where = None, False, "warm-up"
    while True:
        try:
            if iteration is None:
                iteration, logged = _start_from(cfg, session, executor, watch, state, metrics_path, log, stop,
                                                recovering)
                rewards = [float(row["reward_mean"]) for row in logged]
                timed = [(row.get("schedule", cfg.schedule), row["iter_seconds"]) for row in logged]
                if bar is not None:
                    bar.close()
                # Started only now, so that its rate counts RL iterations, not start-up and warm-up.
                bar = tqdm(disable=not progress, desc=session.algorithm.name, unit="it", total=cfg.iterations,
                           initial=iteration)
                kept = checkpoints.metric_rows(metrics_path)
                loggers.restart(iteration if state is not None else min((r["iteration"] for r in kept), default=0),
                                kept)
                if validation is not None and evaluation.pending(cfg, iteration, kept):
                    validate(iteration)
            while iteration < cfg.iterations:
                if stop.requested:
                    raise _interrupted(stop, run_dir, iteration - 1)
                where = f"iteration {iteration}"
                point("iteration:start")
                choice = session.schedule_for(timed)
                trying = None if choice.decided else choice.schedule
                result = _run_iteration(session, executor, watch, session.graphs[choice.schedule], iteration)
                trying = None
                watch.check()  # results computed (even partly) on a replaced worker are not the run's
                out = result.output["report"]
                trace = chrome_trace(result.events, iteration, choice.schedule)
                write_iteration_files(run_dir, iteration, out["rows"], trace)
                metrics = {"iteration": iteration, "phase": "rl", **out["metrics"],
                           "iter_seconds": round(result.seconds, 4), "schedule": choice.schedule,
                           "seconds_by_kind": seconds_by_kind(result.events),
                           "peak_memory_bytes": result.peak_memory_bytes, "alloc_retries": result.alloc_retries,
                           "reward_chance": session.task.chance,
                           **session.loader.metrics()}
                if changed and iteration == changed_at:
                    metrics["config_changed"] = {k: list(v) for k, v in changed.items()}
                append_line(metrics_path, json.dumps(metrics, sort_keys=True))
                loggers.log(metrics)
                point("iteration:written")
                rewards.append(metrics["reward_mean"])
                timed.append((choice.schedule, metrics["iter_seconds"]))
                iteration_seconds.append(result.seconds)
                line = (f"it {iteration:4d}  reward {metrics['reward_mean']:.3f}  kl {metrics['kl']:.4f}  "
                        f"loss {metrics['loss']:+.4f}  |g| {metrics['grad_norm']:.3f}  "
                        f"len {metrics['response_len_mean']:.1f}  {result.seconds:.2f}s")
                if len(session.schedules) > 1:  # schedule: auto
                    line += f"  {choice.schedule}"
                if not choice.decided and (kept := session.schedule_for(timed)).decided:
                    line += "\n" + kept.describe(cfg.schedule_trials)
                bar.write(line) if progress else log(line)
                bar.update(1)
                moving = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:])
                done = (cfg.stop_at_reward is not None and len(rewards) >= MOVING_WINDOW
                        and moving >= cfg.stop_at_reward)
                if checkpoints.due(iteration, cfg) or done or stop.requested:
                    session.checkpoint(executor, iteration, reward=metrics["reward_mean"],
                                       pids=set(watch.known.values()))
                last = done or iteration == cfg.iterations - 1
                if validation is not None and not stop.requested and evaluation.due_after(cfg, iteration, last):
                    validate(iteration + 1)  # after the checkpoint: a resumed run owes it if it is missing
                iteration += 1
                if done:
                    bar.write(f"mean reward of the last {MOVING_WINDOW} iterations {moving:.3f} ≥ "
                              f"{cfg.stop_at_reward}: stopping")
                    break
            break
        except Interrupted:
            raise
        except Exception as exc:
            lost = str(exc) if isinstance(exc, WorkerLost) else watch.lost()
            # schedule: auto's candidate that ran out of device memory is dropped, where fresh workers can
            # be had: the failed iteration left gradients and engine state half-written.
            dropped = trying if lost is None and trying and session.worker_processes and out_of_memory(exc) else None
            if lost is None and dropped is None:
                bar.leave = False
                bar.close()  # cleared: the error's one line is all the console keeps
                raise _failure(exc, where, run_dir, cfg) from exc
            if stop.requested:
                raise _interrupted(stop, run_dir, None) from None
            drop_tracebacks(exc)
        # A lost worker, or a dropped candidate. Out of the except block: the exception's traceback
        # holds the failed iteration's future, and the scheduler releases its tasks only once nothing does.
        state = checkpoints.latest(run_dir)
        back = f"rolling back to {state.directory.name if state else 'the beginning'} and replaying from there"
        if dropped is not None:
            session.drop_schedule(dropped, f"out of device memory in {where}")
            log(f"{where}: schedule auto's candidate {dropped} ran out of device memory; timing "
                f"{', '.join(session.schedules)} without it; restarting the workers, {back}")
            if session.world == 1:  # reform_ranks below restarts a data-parallel run's ranks
                from rollplex.pipeline.run.cluster import restart_workers

                restart_workers(client, log)
        else:
            log(f"{where}: lost a Dask worker: {lost}; {back}")
        trying = None
        if session.world > 1:  # the survivors' process group lost a member: restart every rank afresh
            from rollplex.pipeline.run.cluster import reform_ranks

            executor.ranks = reform_ranks(client, session.host_spec(), session.world, watch, log)
        if iteration is not None:
            watch.forget(task_key(iteration, ""))
        if session.world == 1:
            watch.await_replacements(log)
        client.run(quiet_task_errors)
        if faults.active():
            client.run(faults.install_task_hooks)
        iteration, recovering = None, True
    bar.close()
    steady = iteration_seconds[2:] or iteration_seconds
    final = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:]) if rewards else float("nan")
    return RunSummary(run_dir, len(rewards), final, sum(steady) / max(len(steady), 1))


def _run_iteration(session: Session, executor, watch, graph, iteration: int):
    """One iteration on the workers. The driver sends its prompts as item indices (the workers build
    them); a prompt that fails to build there leaves the loader as it was before this batch, is
    skipped (``data.on_bad_row: skip``, else its DataError ends the run) and the batch is taken again.
    The next batch's indices go along, so a worker builds them while this iteration runs."""
    from rollplex.pipeline.run.executor import task_key
    from rollplex.pipeline.run.recovery import drop_tracebacks
    from rollplex.tasks.data import BadPrompt

    loader, left = session.loader, session.cfg.iterations - iteration - 1
    while True:
        before = loader.state_dict()
        refs = session.balanced(loader.next_refs(batches_left=left))
        after = loader.state_dict()
        upcoming = [r.index for r in loader.next_refs()] if left > 0 else []
        loader.load_state_dict(after)
        try:
            return executor.run(graph, iteration, graph.feed(refs), upcoming)
        except BadPrompt as exc:
            drop_tracebacks(exc)  # its frames hold the failed attempt's future, which forget waits out
            bad = exc
        loader.load_state_dict(before)
        loader.skip(bad)
        del bad
        watch.forget(task_key(iteration, ""))  # the retry reuses the failed attempt's keys


def _interrupted(stop, run_dir: Path, finished: int | None) -> Interrupted:
    done = checkpoints.latest_name(run_dir)
    if done is None:
        what = "before the first checkpoint; --resume starts the run again"
    elif finished is None:
        what = f"the last checkpoint is {done}"
    else:
        what = f"after iteration {finished}, checkpoint {done} written"
    return Interrupted(f"{stop.name}: stopped {what}; continue with: rollplex train --resume {run_dir}",
                       stop.signum)


def _run_warmup(cfg: RunConfig, session: Session, executor, metrics_path: Path, log, stop) -> None:
    what = "answer format" if session.environment is None else "turn format (tool calls and answers)"
    log(f"warm-up: {cfg.warmup.steps} supervised steps on the {what} (targets are random valid "
        f"answers, not the true ones, so the reward stays at chance ≈ {session.task.chance:.2f})")
    for step in range(cfg.warmup.steps):
        if stop.requested:  # no state worth a checkpoint before warm-up ends: abandon it
            raise _interrupted(stop, session.run_dir, None)
        t = time.time()
        # The worker draws and builds the step's examples from the seed: only these numbers travel.
        loss = executor.call(_warmup, [cfg.seed, 7919], step, cfg.warmup.batch_size, cfg.warmup.lr)
        row: dict[str, Any] = {"iteration": -cfg.warmup.steps + step, "phase": "warmup", "warmup_step": step,
                               "warmup_loss": loss, "iter_seconds": round(time.time() - t, 4)}
        append_line(metrics_path, json.dumps(row, sort_keys=True))
        point("warmup:step")
    executor.call(_end_warmup)
    executor.call(_sync_decode, stream="decode")
    target = session.run_dir / "reference"
    staging = session.run_dir / ".reference-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    executor.call(_adopt_reference, str(staging))
    session.processor.save_pretrained(str(staging))  # so that reference/ loads alone, like a checkpoint
    checkpoints.write_manifest(staging)  # a resume verifies the reference before its frozen models load it
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    log(f"warm-up done: loss {loss:.3f}; the reference model is now the warmed-up policy")
