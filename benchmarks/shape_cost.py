"""What a training forward and backward pay the first time they meet a shape.

A training node's packed suffix forward is [groups, width] on top of the prefix KV, and the width is
the groups' response tokens, new every iteration. This times the node's work (policy prefix forward,
packed suffix log-probs, backward) on fresh response lengths and then on the same lengths again,
with cuDNN's attention on and off, and counts the allocator's device allocations in each call.

    python benchmarks/shape_cost.py --shapes 5 --groups 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--shapes", type=int, default=5, help="fresh response-length draws per setting")
    ap.add_argument("--groups", type=int, default=2, help="prompt groups per forward (a micro-batch)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--vision-tokens", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth (a CPU smoke run)")
    ap.add_argument("--settings", default="cudnn,nocudnn,cudnn",
                    help="comma list of cudnn / nocudnn, run in that order, each on its own fresh lengths")
    args = ap.parse_args()

    from rollplex.engines import vlm
    from scoring_setup import draw_responses, scoring_setup

    cfg, model, prompts, visions = scoring_setup(args.model, args.groups, args.max_new_tokens, args.vision_tokens,
                                                 args.device, args.layers)
    cuda = args.device == "cuda"
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)

    def draw() -> list[list[list[int]]]:
        return draw_responses(cfg, len(prompts), vocab, gen, capped=False)

    def allocations() -> int:
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if cuda else 0

    def step(responses) -> tuple[float, int]:
        before = allocations()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        prefixes = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
        scored = vlm.suffix_logprobs_batch(model, prefixes, responses, pad_id=0, grad=True)
        loss = sum((lp * mask).sum() for lp, mask in scored)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        return seconds, allocations() - before

    step(draw())  # handles, kernels' first loads: not a per-shape cost
    step(draw())
    for setting in args.settings.split(","):
        torch.backends.cuda.enable_cudnn_sdp(setting == "cudnn")
        first, again = [], []
        for _ in range(args.shapes):
            responses = draw()
            width = max(sum(len(r) - 1 for r in g) for g in responses)
            (t1, a1), (t2, a2) = step(responses), step(responses)
            first.append(t1)
            again.append(t2)
            print(f"{setting:8s} width {width:5d}: new shape {t1 * 1e3:7.1f} ms ({a1:3d} device allocs), "
                  f"again {t2 * 1e3:7.1f} ms ({a2:3d})")
        print(f"{setting:8s} median: new shape {statistics.median(first) * 1e3:.1f} ms, again "
              f"{statistics.median(again) * 1e3:.1f} ms, per-shape cost "
              f"{statistics.median(a - b for a, b in zip(first, again)) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
