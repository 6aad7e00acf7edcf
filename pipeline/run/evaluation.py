"""Validation (``eval.*``): the current policy decodes held-out prompts and the reward scores them;
nothing trains and no weight changes.

An evaluation is a host operation between iterations (``executor.call`` on the decode stream), not
a compiled graph of its own: it has no scoring, update or weight sync that could share a decode
window, so the compiled iteration, its window and the engines stay exactly as they are. Its
requests carry their own samples, temperature and seeds (``DecodeRequest``), so no engine setting
changes, and it runs the decode engine until no request is left, so the next iteration starts on
the engine as it would have without it; a run's training rollouts are the same with validation on
or off (tests/test_evaluation.py). A multi-turn run's validation plays whole episodes through the
run's environment, turn by turn as its rollouts do (tests/test_multiturn.py).

The evaluation after RL iteration N runs the policy that samples iteration N + 1, so it is
recorded as iteration N + 1: the row ``{"phase": "eval", "iteration": N + 1, "val/reward_mean": ...}``
in metrics.jsonl and its responses in ``eval/iter_{N+1:06d}.jsonl``, beside ``rollouts/`` of the
same policy; ``eval.before_train`` writes iteration 0. It runs after iteration N's checkpoint, and a
run resumed from that checkpoint runs it if its row is missing (``pending``).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rollplex.errors import DataError
from rollplex.fsio import atomic_write_text


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n samples of which c pass (Chen et al., 2021): 1 − C(n−c, k)/C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def enabled(cfg) -> bool:
    return bool(cfg.eval.every or cfg.eval.before_train)


def due_after(cfg, iteration: int, last: bool) -> bool:
    """Whether RL iteration ``iteration`` (the run's ``last``) is followed by a validation."""
    every = cfg.eval.every
    return every > 0 and ((iteration + 1) % every == 0 or last)


def pending(cfg, first: int, rows: list[dict]) -> bool:
    """Whether a run (re)starting at RL iteration ``first`` owes the validation recorded as ``first``:
    before training, or after iteration ``first - 1``, when metrics.jsonl has no row of it."""
    owed = cfg.eval.before_train if first == 0 else due_after(cfg, first - 1, first - 1 == cfg.iterations - 1)
    return owed and not any(r.get("phase") == "eval" and r.get("iteration") == first for r in rows)


def probe(task, builder) -> None:
    """Build the first validation prompts on the driver, so that a val set the engines cannot take
    (too long, unreadable) is refused before anything starts rather than at the first evaluation."""
    from rollplex.tasks.data import build_item
    from rollplex.tasks.dataset import PROBE_ROWS

    for index in range(min(len(task), PROBE_ROWS)):
        try:
            build_item(task, builder, index)
        except DataError:
            if getattr(task, "on_bad_row", "reject") != "skip":
                raise


class Validation:
    """The driver's side: which prompts, in batches the decode engine holds, and what is recorded."""

    def __init__(self, cfg, task, run_dir: Path) -> None:
        from rollplex.tasks.data import PromptRef

        e = cfg.eval
        self.cfg, self.task, self.run_dir = cfg, task, run_dir
        count = min(e.prompts or len(task), len(task))
        self.refs = [PromptRef(i, task.prompt_id(i)) for i in range(count)]
        # The decode engine is sized for one rollout batch of sequences (its KV pool and row slots).
        capacity = cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt
        self.per_call = max(1, capacity // e.samples)

    def run(self, executor, iteration: int, pids: set[int]) -> dict:
        """Validate the policy that samples RL iteration ``iteration``; its metrics row. Data-parallel
        ranks each take a contiguous share of the prompts (a tensor-parallel decode group one share
        for all its ranks); the rows come back in prompt order, and a prompt's samples follow its
        seed, not its rank, so they are those one worker would draw."""
        e = self.cfg.eval
        start = time.time()
        ranks, tp = max(1, len(getattr(executor, "ranks", None) or ())), self.cfg.cluster.tp_rollout
        groups = max(1, ranks // tp)
        size = -(-len(self.refs) // groups)
        shares = [self.refs[g * size:(g + 1) * size] for g in range(groups)]
        rows_of: list[list[dict]] = [[] for _ in range(groups)]
        skipped = []
        for at in range(0, size, self.per_call):
            outs = executor.call_each(_evaluate, [(shares[r // tp][at:at + self.per_call], iteration, e.samples,
                                                   e.temperature, pids, self.cfg.rollout.max_turns)
                                                  for r in range(ranks)], stream="decode")
            for g in range(groups):
                out = outs[g * tp]  # a group's ranks decode its share together: its first rank's rows
                rows_of[g] += out["rows"]
                skipped += out["skipped"]
        rows = [row for share in rows_of for row in share]
        atomic_write_text(self.run_dir / "eval" / f"iter_{iteration:06d}.jsonl",
                          "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        return {"iteration": iteration, "phase": "eval", **self.metrics(rows),
                "eval_seconds": round(time.time() - start, 4),
                **({"val/data_skipped_rows": len(self.task.bad_rows) + len(skipped)}
                   if hasattr(self.task, "bad_rows") else {})}

    def metrics(self, rows: list[dict]) -> dict:
        e = self.cfg.eval
        rewards = [r["reward"] for r in rows]
        groups: dict[str, list[float]] = {}
        for r in rows:
            groups.setdefault(r["prompt_id"], []).append(r["reward"])
        mean = sum(rewards) / max(len(rewards), 1)
        out = {"val/reward_mean": mean,
               "val/reward_std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
               if len(rewards) > 1 else 0.0,
               # the policy's tokens: a multi-turn trajectory's environment answers are not its response
               "val/response_len_mean": sum(sum(r["response_mask"]) if "response_mask" in r
                                            else len(r["response_token_ids"]) for r in rows) / max(len(rows), 1)}
        if rows and "turns" in rows[0]:  # multi-turn: what the episodes did, as the training rows log it
            out.update({"val/turns_mean": sum(len(r["turns"]) for r in rows) / len(rows),
                        "val/tool_calls_mean": sum(r["tool_calls"] for r in rows) / len(rows),
                        "val/tool_use_rate": sum(r["tool_calls"] > 0 for r in rows) / len(rows)})
        for k in sorted({1, e.samples}):
            out[f"val/pass@{k}"] = sum(pass_at_k(len(g), sum(x >= e.pass_reward for x in g), k)
                                       for g in groups.values()) / max(len(groups), 1)
        return out

    def describe(self, row: dict) -> str:
        k = self.cfg.eval.samples
        passes = "  ".join(f"pass@{j} {row[f'val/pass@{j}']:.3f}" for j in sorted({1, k}))
        return (f"eval {row['iteration']:4d}  val reward {row['val/reward_mean']:.3f}  {passes}  "
                f"({len(self.refs)} prompts × {k}, {row['eval_seconds']:.2f}s)")


def _evaluate(host, refs: list, iteration: int, samples: int, temperature: float, pids: set[int],
              turns: int = 1) -> dict:
    """On the worker: decode ``samples`` responses to each prompt of ``refs`` (the validation set's
    item indices) on the decode engine's current weights, reward them; the rows of eval/iter_N.jsonl.
    A multi-turn run's validation plays whole episodes (``_play``)."""
    from rollplex.engines import vlm
    from rollplex.pipeline.run.recovery import expect_host
    from rollplex.tasks.data import BadPrompt
    from rollplex.tasks.nodes import prompt_request, sample_key, sample_seed

    expect_host(pids)  # a replacement worker's fresh weights are not the policy being validated
    s = host.spec.settings
    built, skipped = [], []
    for ref in refs:
        try:
            built.append((ref.index, host.eval_prompts.resolve(ref)))
        except BadPrompt as exc:
            if getattr(host.spec.eval_task, "on_bad_row", "reject") != "skip":
                raise DataError(str(exc)) from None
            skipped.append(str(exc))
    if not built:
        return {"rows": [], "skipped": skipped}
    prompts = [p for _, p in built]
    visions = vlm.vision_embeds_batch(host.model(host.algorithm.vision_model), prompts)
    requests = [prompt_request(f"eval{iteration}-p{index}", p, v, s, n=samples, temperature=temperature,
                               seed=sample_seed(s.seed, iteration, f"eval/{p.prompt_id}"),
                               top_p=s.top_p if temperature > 0 else 1.0)
                for (index, p), v in zip(built, visions)]
    if turns > 1:
        return {"rows": _play(host, prompts, visions, requests, turns), "skipped": skipped}
    host.decode.add_requests(requests)
    finished = {}
    while host.decode.has_unfinished():  # every request runs to its end: the engine is left empty
        for seq in host.decode.step(s.max_new_tokens):
            finished[sample_key(seq)] = seq
    rows = []
    for prompt, request in zip(prompts, requests):
        for g in range(samples):
            seq = finished[(request.request_id, g)]
            text = host.decode_text(seq.token_ids)
            rows.append({"prompt_id": prompt.prompt_id, "sample": g, "prompt_token_ids": prompt.input_ids.tolist(),
                         "images": prompt.meta.get("images", []), "response_token_ids": list(seq.token_ids),
                         "text": text, "answer": prompt.answer, "reward": float(host.reward_fn(text, prompt.answer)),
                         "rollout_logprobs": [float(x) for x in seq.logprobs]})
    return {"rows": rows, "skipped": skipped}


def _play(host, prompts: list, visions: list, requests: list, turns: int) -> list[dict]:
    """Validation's episodes, turn by turn as a rollout plays them (tasks/turns.py): decode every live
    sample to the end of its turn, step the environments, encode the answers' images, continue the
    samples that go on, sampled as their first turn was. Every request runs to its end, so the
    decode engine is left empty."""
    import dataclasses

    from rollplex.tasks.nodes import sample_key
    from rollplex.tasks.turns import Episode, answer_turns, next_turn_requests, observation_embeds, turn_row

    s, engine = host.spec.settings, host.decode
    episodes, owner = {}, {}
    for p, (prompt, vision, request) in enumerate(zip(prompts, visions, requests)):
        for g in range(request.n):
            episodes[(p, g)] = Episode((p, g), prompt, vision, request.seed, request_id=request.request_id)
            owner[(request.request_id, g)] = (p, g)
    engine.add_requests([dataclasses.replace(r, keep_kv=True) for r in requests])
    for turn in range(turns):
        handed = {}
        while engine.has_unfinished():
            for seq in engine.step(s.max_new_tokens):
                key = owner.pop(sample_key(seq))
                episodes[key].add_response(seq, turn)
                handed[key] = episodes[key]
        answers = answer_turns(host, dict(sorted(handed.items())), turn == turns - 1, s.max_new_tokens)
        if turn == turns - 1:  # every episode ends here; the engine kept no KV of this turn
            for key in sorted(answers):
                episodes[key].add_answer(answers[key], None)
            break
        embeds = observation_embeds(host.model(host.algorithm.vision_model), answers)
        continued, ended = next_turn_requests(episodes, answers, embeds, turn + 1, turns, s,
                                              temperature=requests[0].temperature, top_p=requests[0].top_p)
        engine.release(ended)
        for key, request, _ in continued:
            owner[(request.request_id, 0)] = key
        engine.add_requests([request for _, request, _ in continued])
    rows = []
    for key in sorted(episodes):
        seq = episodes[key].trajectory()
        prompt = episodes[key].prompt
        rows.append({"prompt_id": prompt.prompt_id, "sample": key[1], "prompt_token_ids": prompt.input_ids.tolist(),
                     "images": prompt.meta.get("images", []), "response_token_ids": list(seq.token_ids),
                     "text": host.decode_text(seq.token_ids), "answer": prompt.answer, "reward": float(seq.reward),
                     "rollout_logprobs": [float(x) for x in seq.logprobs], **turn_row(host, seq)})
    return rows
