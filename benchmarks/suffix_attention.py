"""A packed suffix's attention: the dense-masked kernel against responses cut apart (varlen flash).

Times what a training node and a scoring node pay for one micro-batch of prompt groups at the
bench's shape (random-weight preset, bf16, one image of 1,024 vision tokens per prompt, G = 8):
the policy's prefix forward, the packed suffix log-probs and the backward (train), and the suffix
log-probs without grad (score). The variants take turns trial by trial, so each trial is one paired
sample; ``dense#aa`` is the dense variant run a second time (the A/A line). With ``--groups`` above
one, ``varlen-split`` runs the groups one forward and backward each, as a fused training node does
when a group's tokens exceed the logits budget, against serial's one forward over all of them.

    python benchmarks/suffix_attention.py --trials 8 --lengths cap     # every response at its cap
    python benchmarks/suffix_attention.py --trials 8 --lengths lognormal
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def paired(a: list[float], b: list[float]) -> str:
    """Median of b/a per trial with the lowest and highest ratio."""
    r = sorted(y / x for x, y in zip(a, b))
    return f"{statistics.median(r):.2f}× ({r[0]:.2f}–{r[-1]:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--groups", type=int, default=1, help="prompt groups per forward (a micro-batch)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--lengths", choices=("cap", "lognormal"), default="cap")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="fewer LM layers (a CPU smoke run)")
    ap.add_argument("--vision-tokens", type=int, default=1024)
    args = ap.parse_args()

    from rollplex.engines import vlm
    from scoring_setup import draw_responses, scoring_setup

    cfg, model, prompts, visions = scoring_setup(args.model, args.groups, args.max_new_tokens, args.vision_tokens,
                                                 args.device, args.layers)
    cuda = args.device == "cuda"
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)

    def draw() -> list[list[list[int]]]:
        return draw_responses(cfg, len(prompts), vocab, gen, capped=args.lengths == "cap")

    def timed(fn) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        return time.perf_counter() - t, peak

    def train(responses, attention):
        split = attention.endswith("-split")
        vlm.SUFFIX_ATTENTION = attention.removesuffix("-split")
        for part in ([[i] for i in range(len(prompts))] if split else [list(range(len(prompts)))]):
            prefixes = vlm.prefix_forward_batch(model, [prompts[i] for i in part], [visions[i] for i in part],
                                                grad=True)
            scored = vlm.suffix_logprobs_batch(model, prefixes, [responses[i] for i in part], pad_id=0, grad=True)
            sum((lp * mask).sum() for lp, mask in scored).backward()
        model.zero_grad(set_to_none=True)

    def score(responses, attention):
        vlm.SUFFIX_ATTENTION = attention.removesuffix("-split")
        with torch.no_grad():
            prefixes = vlm.prefix_forward_batch(model, prompts, visions, grad=False)
            vlm.suffix_logprobs_batch(model, prefixes, responses, pad_id=0, grad=False)

    variants = ["dense", "varlen", "dense#aa"] + (["varlen-split"] if args.groups > 1 else [])
    times = {(w, v): [] for w in ("train", "score") for v in variants}
    peaks = {(w, v): 0.0 for w in ("train", "score") for v in variants}
    warm = draw()
    for v in variants:  # kernels' first loads
        train(warm, v.split("#")[0])
        score(warm, v.split("#")[0])
    tokens = []
    for trial in range(args.trials):
        responses = draw()
        tokens.append(sum(len(r) for g in responses for r in g))
        order = variants[trial % len(variants):] + variants[:trial % len(variants)]
        for v in order:
            for work, fn in (("train", train), ("score", score)):
                s, peak = timed(lambda: fn(responses, v.split("#")[0]))
                times[work, v].append(s)
                peaks[work, v] = max(peaks[work, v], peak)
    print(f"{args.model}, {args.groups} group(s) of {cfg.samples}, responses {args.lengths} "
          f"(mean {statistics.mean(tokens) / args.groups / cfg.samples:.0f} tokens), {args.trials} trials")
    for work in ("train", "score"):
        for v in variants:
            print(f"  {work:5s} {v:12s} median {statistics.median(times[work, v]) * 1e3:8.1f} ms  peak {peaks[work, v]:6.1f} GiB")
        print(f"  {work:5s} dense ÷ varlen {paired(times[work, 'varlen'], times[work, 'dense'])}; "
              f"A/A dense#aa ÷ dense {paired(times[work, 'dense'], times[work, 'dense#aa'])}")
        if args.groups > 1 and work == "train":
            print(f"  train varlen-split ÷ varlen {paired(times[work, 'varlen'], times[work, 'varlen-split'])}")


if __name__ == "__main__":
    main()
