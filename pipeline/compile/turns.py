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
"""
from __future__ import annotations


def add_turns(g, shape, add, host, dev, dims, policy: str, vision_model: str, vision_role: str,
              every: tuple[int, ...]) -> None:
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
                vis = f"obsvis_t{t}_c{c}"
                add(f"vit_obs_t{t}_c{c}", "vit_observation", [obs], [vis], model=vision_model, role=vision_role,
                    args={"turn": t, "chunk": c},
                    **{vis: dev(dims.vision_bytes(per_chunk * shape.observation_tokens), "vision", model=vision_model,
                                prompts=every, chunk=c, label="observation")})
    outputs = [f"responses_p{p}" for p in range(P)] + ["rollout_stats"]
    info = {f"responses_p{p}": host(G * shape.continuation_tokens * 12, "responses", model=policy, prompts=(p,))
            for p in range(P)}
    info["rollout_stats"] = host(64, "rollout_stats", model=policy, prompts=every)
    add("episodes", "join", [state] + [f"obs_t{T - 1}_c{k}" for k in range(C)], outputs,
        args={"episodes": True, "prompts": list(range(P)), "samples": G}, **info)
