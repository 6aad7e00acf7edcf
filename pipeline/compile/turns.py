"""The rollout of a multi-turn iteration: ``BatchShape.max_turns`` turns of decode chunks, each
finished sample's environment step, and the vision encoding of the new images (tasks/turns.py).

For T turns of C chunks (K tokens each), P prompts:

    %decode_t0_c0 ─▶ %decode_t0_c1 ─▶ ... ─▶ %decode_t0_c{C-1} ─┐
        │ turn_t0_c0       │ turn_t0_c1               │           │ (state)
        ▼                  ▼                          ▼           ▼
    %env_t0_c0         %env_t0_c1       ...       %env_t0_c{C-1}  │
        │ obs                                         │           │
        ▼                                             ▼           ▼
    %vit_obs_t0_c0     ...                        %vit_obs_t0_c{C-1} ─▶ %decode_t1_c0 ─▶ ...
                                     ... %decode_t{T-1}_c{C-1} and %env_t{T-1}_c* ─▶ %episodes

Each chunk hands on the samples whose turn ended in it, so their environments (host stream) and
the vision tower (compute stream) work while the rest of the turn decodes; the next turn starts
once every sample of this one is answered, so its batch is the same under every schedule. The last
turn's environments judge the final answers; ``%episodes`` then hands on each prompt's
``responses_p{p}`` (its G trajectories) and ``rollout_stats``, which everything after decode reads
as in a single-turn iteration.

Each frozen model that scores log-probs works per turn and chunk, and with stage fusion (the
rollplex schedule) on the compute stream while decode goes on; without it (serial) the same nodes
wait for the last decode chunk, so both schedules compute the same numbers:

    %decode_t0_c0 ─▶ %env_t0_c0 ─▶ %vit_obs_t0_c0 ─▶ %suffix_ref_logprobs_t0_c0 ─┐ (state per sample)
    %prefix_ref_p*  ─────────────────────────────────────────────┘                 ▼
                                               %suffix_ref_logprobs_t1_c* (any chunk of turn 1)

``%suffix_ref_logprobs_t{t}_c{c}`` forwards, for each sample chunk c ended turn t of, that turn's
response and the environment's answer (its new tokens and images) on the sample's history (the
prompt's prefix, or the state turn t-1 left), keeping the KV for turn t+1; a trajectory that ends
hands on its log-probs, and ``%join_ref_logprobs`` gathers them per prompt. So the reference's work
for turn t runs while turn t+1 decodes, and none of it waits for the last turn.
"""
from __future__ import annotations


def add_turns(g, shape, add, host, dev, dims, policy: str, vision_model: str, vision_role: str,
              every: tuple[int, ...], scores: list[tuple[str, str, str]] = ()) -> None:
    """``scores``: (as, model, role) of the frozen log-prob scores fused per turn (their prefix
    values ``prefix_{model}_p{p}`` made by the caller). With a vision tower that trains
    (``shape.trains_vision``) the rollout's observations go through the policy's tower and each
    frozen model's through its own (``vit_obs_{model}_t{t}_c{c}``), as their prompts' images do."""
    own_tower = {model for _, model, _ in scores if shape.trains_vision and model != vision_model}
    P, G, T, C, K = shape.prompts, shape.samples, shape.max_turns, shape.chunks, shape.chunk_tokens
    per_chunk = P * G / C  # samples a chunk hands on, for the byte estimates
    state = None
    for t in range(T):
        for c in range(C):
            if t == 0 and c == 0:
                inputs = [f"prompt_p{p}" for p in range(P)] + [f"vis_p{p}" for p in range(P)]
            elif c == 0:
                inputs = [state] + [f"{v}_t{t - 1}_c{k}" for v in ("obs", "obsvis") for k in range(C)]
            else:
                inputs = [state]
            state, turn = f"decode_state_t{t}_c{c}", f"turn_t{t}_c{c}"
            add(f"decode_t{t}_c{c}", "decode_chunk", inputs, [state, turn], model=policy,
                args={"chunk": c, "chunks": C, "tokens": K, "turn": t, "turns": T},
                **{state: host(P * G * shape.continuation_tokens * 8, "decode_state", model=policy, prompts=every,
                               chunk=c),
                   turn: host(per_chunk * shape.continuation_tokens * 12, "turn", model=policy, prompts=every,
                              chunk=c)})
            obs = f"obs_t{t}_c{c}"
            add(f"env_t{t}_c{c}", "env_step", [turn], [obs], args={"turn": t, "turns": T, "chunk": c},
                **{obs: host(per_chunk * shape.observation_tokens * 8, "observation", prompts=every, chunk=c)})
            if t < T - 1:
                for model, role in [(vision_model, vision_role)] + [(m, r) for _, m, r in scores if m in own_tower]:
                    tag = "" if model == vision_model else f"{model}_"
                    vis = f"obsvis_{tag}t{t}_c{c}"
                    if vis in g.values:
                        continue
                    add(f"vit_obs_{tag}t{t}_c{c}", "vit_observation", [obs], [vis], model=model, role=role,
                        args={"turn": t, "chunk": c},
                        **{vis: dev(dims.vision_bytes(per_chunk * shape.observation_tokens), "vision", model=model,
                                    prompts=every, chunk=c, label="observation")})
            for as_, model, role in scores:
                _score_turn(shape, add, dev, dims, as_, model, role, t, c, per_chunk, every,
                            tag=f"{model}_" if model in own_tower else "")
    outputs = [f"responses_p{p}" for p in range(P)] + ["rollout_stats"]
    info = {f"responses_p{p}": host(G * shape.continuation_tokens * 12, "responses", model=policy, prompts=(p,))
            for p in range(P)}
    info["rollout_stats"] = host(64, "rollout_stats", model=policy, prompts=every)
    add("episodes", "join", [state] + [f"obs_t{T - 1}_c{k}" for k in range(C)], outputs,
        args={"episodes": True, "prompts": list(range(P)), "samples": G}, **info)
    if not shape.fused:  # without stage fusion (serial) each turn's scoring waits for the rollout's end
        last = f"decode_t{T - 1}_c{C - 1}"
        for as_, _, _ in scores:
            for t, c in ((t, c) for t in range(T) for c in range(C) if (t, c) != (T - 1, C - 1)):
                g.add_order(last, f"suffix_{as_}_t{t}_c{c}", reason="no stage fusion")
    for as_, model, _ in scores:
        parts = [f"{as_}_t{t}_c{c}" for t in range(T) for c in range(C)]
        add(f"join_{as_}", "join", parts, [f"{as_}_p{p}" for p in range(P)], args={"prompts": list(range(P)), "samples": G},
            **{f"{as_}_p{p}": dev(dims.score_bytes(G * shape.continuation_tokens), "score", model=model, prompts=(p,),
                                  label=as_) for p in range(P)})


def _score_turn(shape, add, dev, dims, as_: str, model: str, role: str, t: int, c: int, per_chunk: float,
                every: tuple[int, ...], tag: str = "") -> None:
    """``%suffix_{as}_t{t}_c{c}``: the frozen model on the samples chunk c ended turn t of (module
    docstring); ``tag``: whose observation vision it reads (``obsvis_{tag}t{t}_c{c}``)."""
    T, C = shape.max_turns, shape.chunks
    history = ([f"prefix_{model}_p{p}" for p in range(shape.prompts)] if t == 0 else
               [f"{as_}_history_t{t - 1}_c{k}" for k in range(C)])
    inputs = history + [f"turn_t{t}_c{c}", f"obs_t{t}_c{c}"] + ([f"obsvis_{tag}t{t}_c{c}"] if t < T - 1 else [])
    out, state = f"{as_}_t{t}_c{c}", f"{as_}_history_t{t}_c{c}"
    info = {out: dev(dims.score_bytes(per_chunk * shape.continuation_tokens), "score", model=model, prompts=every,
                     chunk=c, label=as_)}
    if t < T - 1:  # the trajectories that go on: their KV so far
        turn_end = shape.prompt_tokens + (t + 1) * (shape.max_new_tokens + shape.observation_tokens)
        info[state] = dev(per_chunk * dims.kv_bytes(turn_end), "score_state", model=model, prompts=every, chunk=c)
    add(f"suffix_{as_}_t{t}_c{c}", "suffix_score", inputs, list(info), model=model, role=role,
        args={"prompts": list(range(shape.prompts)), "as": as_, "grad": False, "head": "lm", "turn": t, "turns": T,
              "chunk": c}, **info)
