"""What a training forward keeps for its backward, with and without train.gradient_checkpointing.

Counts the bytes autograd saves (``saved_tensors_hooks``) over the policy's prefix forward and its
packed suffix log-probs for one prompt group, on the random-weight preset cut to a few of its
decoder layers, without and then with the layers recomputing (engines/recompute.py). Two depths
give the per-layer share, which is what checkpointing changes; the rest (embeddings, the LM head in
pieces) stays. A byte count, not a timing: the same on any machine.

    python benchmarks/activation_memory.py --layers 2,4 --new-tokens 256 --vision-tokens 256
"""
from __future__ import annotations

import argparse

import torch


def kept_bytes(model, prompts, visions, responses) -> int:
    from rollplex.engines import vlm

    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
        scored = vlm.suffix_logprobs_batch(model, states, responses, pad_id=0, grad=True)
    sum((lp * mask).sum() for lp, mask in scored).backward()
    model.zero_grad(set_to_none=True)
    return sum(sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--layers", default="2,4", help="depths to build (two or more give the per-layer share)")
    ap.add_argument("--new-tokens", type=int, default=256, help="each of the group's 8 responses")
    ap.add_argument("--vision-tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from rollplex.engines import recompute
    from scoring_setup import draw_responses, scoring_setup

    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        cfg, model, prompts, visions = scoring_setup(args.model, 1, args.new_tokens, args.vision_tokens, args.device,
                                                     layers, args.dtype)
        responses = draw_responses(cfg, 1, model.config.get_text_config().vocab_size, torch.Generator().manual_seed(0),
                                   capped=True)
        kept = kept_bytes(model, prompts, visions, responses)
        recompute.checkpoint_layers(model)
        recomputed = kept_bytes(model, prompts, visions, responses)
        tokens = prompts[0].num_tokens + cfg.samples * args.new_tokens
        rows.append((layers, kept, recomputed))
        print(f"{layers} layers, {tokens} tokens ({args.dtype}): kept {kept / 2**20:,.0f} MiB, "
              f"recomputing {recomputed / 2**20:,.0f} MiB")
        del model
    if len(rows) > 1:
        (l0, a0, b0), (l1, a1, b1) = rows[0], rows[-1]
        per_a, per_b = (a1 - a0) / (l1 - l0), (b1 - b0) / (l1 - l0)
        print(f"per decoder layer: {per_a / 2**20:,.1f} MiB kept, {per_b / 2**20:,.1f} MiB recomputing "
              f"({per_a / per_b:.0f}x less); {per_a / tokens / 1024:.0f} KiB a token kept")


if __name__ == "__main__":
    main()
