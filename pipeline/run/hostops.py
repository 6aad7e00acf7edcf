"""Operations the driver runs on every worker's host between iterations (``executor.call``):
the supervised warm-up step, adopting the warmed-up reference, syncing decode weights, saving,
loading and restoring the engines' state.
"""
from __future__ import annotations

import os

from rollplex.pipeline.run.faults import point


def _warmup_examples(host, seed: int | list[int], step: int, n: int) -> list:
    """Warm-up step ``step``'s ``n`` examples, built here from the run's task (their pixels never
    cross Dask). One generator seeded with ``seed`` draws every step's examples in turn, so a host
    that starts mid-warm-up (a replaced worker) draws the steps before ``step`` again to catch up."""
    import numpy as np

    from rollplex.tasks.data import format_warmup_batch

    if host.prompts is None:
        raise RuntimeError("a warm-up step reached a worker without the run's task")
    task, builder = host.prompts.task, host.prompts.builder
    draws = getattr(host, "warmup_draws", None)
    if draws is None or draws[1] > step or draws[2] != seed:
        draws = [np.random.default_rng(seed), 0, seed]
    host.warmup_draws = draws
    while True:
        if host.environment is not None:  # multi-turn: whole trajectories, the environment's turns included
            examples = host.environment.warmup(task, builder, host.render, draws[0], n)
        else:
            examples = format_warmup_batch(task, builder, draws[0], n)
        draws[1] += 1
        if draws[1] > step:
            return examples


def _warmup(host, seed: int | list[int], step: int, batch_size: int, lr: float) -> float:
    """One supervised answer-format step: -mean log p(target | prompt) on the policy."""
    from rollplex.engines import vlm
    from rollplex.tasks.data import warmup_target_ids

    from rollplex.engines.torch_train import trains_vision

    policy = host.algorithm.rollout_model
    engine = host.train_engine(policy)
    # A vision tower that trains (train.freeze_vision: false) is the policy's, and learns here too.
    vision_trains = trains_vision(engine.module)
    vision_model = engine.module if vision_trains else host.model(host.algorithm.vision_model)
    engine.set_lr(lr)
    examples = _warmup_examples(host, seed, step, batch_size)
    if examples and isinstance(examples[0][1], list):  # multi-turn: whole trajectories
        loss_sum = _warmup_trajectories(host, engine, vision_model, examples)
        engine.step()
        engine.set_lr(host.spec.train_options["lr"])
        return loss_sum
    targets = [warmup_target_ids(host.tokenizer, t) for _, t in examples]
    total = sum(len(ids) for ids in targets)
    loss_sum = 0.0
    # Examples share a forward and a backward as far as the logits budget allows: one example per
    # call made a step on the tiny default model about 1 s, nearly all of it per-call overhead.
    vocab = engine.module.config.get_text_config().vocab_size
    for run in vlm.batches_within([len(ids) for ids in targets], vocab, grad=True):
        prompts = [examples[i][0] for i in run]
        visions = vlm.vision_embeds_batch(vision_model, prompts, grad=vision_trains)
        states = vlm.prefix_forward_batch(engine.module, prompts, visions, grad=True)
        scored = vlm.suffix_logprobs_batch(engine.module, states, [[targets[i]] for i in run],
                                          pad_id=host.spec.settings.pad_id, grad=True)
        loss = -sum((logp * mask).sum() for logp, mask in scored) / total
        engine.backward(loss)
        loss_sum += float(loss.detach())
    engine.step()
    engine.set_lr(host.spec.train_options["lr"])
    return loss_sum


def _warmup_trajectories(host, engine, vision_model, examples: list) -> float:
    """-mean log p of the policy's tokens of supervised trajectories: (prompt, [(target text, the
    rendered observation after it or None), ...]); the observations' tokens are masked out, their
    images go through the vision tower. Returns the loss."""
    import torch

    from rollplex.engines import trajectory, vlm
    from rollplex.tasks.data import warmup_target_ids

    conts, masks = [], []
    for prompt, turns in examples:
        ids, mask, images, grids = [], [], [], []
        for text, rendered in turns:
            target = warmup_target_ids(host.tokenizer, text)
            ids, mask = ids + target, mask + [1] * len(target)
            if rendered is not None:
                ids, mask = ids + rendered.token_ids, mask + [0] * len(rendered.token_ids)
                if rendered.image_grid_thw is not None:
                    obs = vlm.PromptInputs("obs", torch.tensor(rendered.token_ids), pixel_values=rendered.pixel_values,
                                           image_grid_thw=rendered.image_grid_thw)
                    images.append(vlm.vision_embeds(vision_model, obs).image)
                    grids.append(rendered.image_grid_thw)
        conts.append(trajectory.Continuation(ids, torch.cat(images) if images else None,
                                             torch.cat(grids) if grids else None))
        masks.append(torch.tensor(mask, dtype=torch.float32))
    total = sum(float(m.sum()) for m in masks)
    prompts = [p for p, _ in examples]
    loss_sum = 0.0
    vocab = engine.module.config.get_text_config().vocab_size
    for run in vlm.batches_within([len(c.token_ids) for c in conts], vocab, grad=True):
        visions = vlm.vision_embeds_batch(vision_model, [prompts[i] for i in run])
        states = vlm.prefix_forward_batch(engine.module, [prompts[i] for i in run], visions, grad=True)
        scored = trajectory.logprobs_batch(engine.module, states, [[conts[i]] for i in run],
                                           pad_id=host.spec.settings.pad_id, grad=True)
        loss = -sum((lp[0] * masks[i].to(lp.device)).sum() for lp, i in zip(scored, run)) / total
        engine.backward(loss)
        loss_sum += float(loss.detach())
    return loss_sum


def _end_warmup(host) -> None:
    host.train_engine(host.algorithm.rollout_model).reset_optimizer_state()


def _sync_decode(host) -> None:
    engine = host.train_engine(host.algorithm.rollout_model)
    host.decode.load_weights(engine.state_dict_for_sync(trainable_only=True))


def _adopt_reference(host, directory: str) -> None:
    """Make the frozen copies of the policy equal to it now, and save it for resumed runs. With LoRA
    the adapters are folded into the base, which the reference is (it has no weights of its own)."""
    alg = host.algorithm
    policy = host.train_engine(alg.rollout_model)
    policy.fold_adapter()
    weights = None
    for name, decl in alg.models.items():
        # A critic trains its own weights; a model on an engine of its own (a reward model) keeps its.
        if decl.copy_of == alg.rollout_model and not decl.trainable and decl.engine is None:
            if not getattr(host.engines[name], "shares_weights", False):
                weights = weights if weights is not None else dict(policy.state_dict_for_sync())
                host.engines[name].model.load_state_dict(weights)
            host.register_frozen(name)  # cached prefixes of the old weights no longer match
    import torch

    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # one writer per run
    policy.export(directory, is_main_process=main)


def _lora_sizes(host) -> dict | None:
    """The policy's adapter and base sizes (engines.lora.sizes), None without LoRA; and per frozen
    copy of the policy (the reference) the bytes it holds outside the policy's own storage."""
    from rollplex.engines import lora
    from rollplex.pipeline.run.worker import shares_policy_base

    alg = host.algorithm
    policy = host.train_engine(alg.rollout_model)
    if getattr(policy, "peft", None) is None:
        return None
    copies = {m: lora.own_bytes(host.engines[m].model, policy.module) for m in host.spec.frozen
              if m in alg.models and shares_policy_base(alg.models[m], alg.rollout_model)}
    return {**lora.sizes(policy.module), "copies": copies}


def _save(host, directory: str, pids: set[int]) -> None:
    from rollplex.pipeline.run.recovery import expect_host

    expect_host(pids)
    host.train_engine(host.algorithm.rollout_model).save(directory)
    for model in host.algorithm.model_losses:  # other trained models (a critic): a subdirectory each
        host.train_engine(model).save(os.path.join(directory, model))
    point("save:model")


def _load(host, directory: str) -> None:
    host.train_engine(host.algorithm.rollout_model).load(directory)
    for model in host.algorithm.model_losses:
        host.train_engine(model).load(os.path.join(directory, model))
    _sync_decode(host)


def _restore(host, directory: str, reference: str | None) -> None:
    """Bring a host's engines to a checkpoint after a lost worker: finish requests a failed iteration
    left in the decode engine, reload the frozen copies of the policy (a fresh worker built them from
    the initial model), then the policy and its optimizer."""
    from rollplex.engines.torch_train import load_hf_weights

    while host.decode.has_unfinished():
        host.decode.step(host.spec.settings.max_new_tokens)
    alg = host.algorithm
    for name, decl in alg.models.items():
        if reference and decl.copy_of == alg.rollout_model and not decl.trainable and decl.engine is None:
            load_hf_weights(host.engines[name].model, reference)
            host.register_frozen(name)
    _load(host, directory)


# ------------------------------------------------------------------------------------------------
