"""How long the decode thread waits for the GIL while a training thread runs, per switch interval.

In the decode window one thread launches decode steps and another runs the policy's training
forwards and backwards. If the training thread kept the GIL for Python's switch interval (5 ms) the
decode thread, which takes the GIL back for every graph launch, would wait up to that long per 3–4
ms step. This measures the wait: a training thread runs the policy's prefix and packed suffix
forwards with grad and their backward (``engines/vlm.py``, the 3B preset cut to a few layers,
with and without ``train.gradient_checkpointing``), while a decode thread repeatedly runs one op,
drops the GIL and times how long taking it back takes. PyTorch releases the GIL inside each op,
so the wait is bounded by the Python between two ops, not by the switch interval; the numbers say
by how much. A CPU measurement of CPython's GIL hand-over, not of a GPU.

    python benchmarks/gil_wait.py --layers 2 --vision-tokens 256 --new-tokens 64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch


def train_loop(model, prompts, visions, responses, stop: threading.Event, stepped: threading.Event) -> None:
    from rollplex.engines import vlm

    while not stop.is_set():
        states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
        scored = vlm.suffix_logprobs_batch(model, states, responses, pad_id=0, grad=True)
        sum((lp * mask).sum() for lp, mask in scored).backward()
        model.zero_grad(set_to_none=True)
        stepped.set()


def retake_waits(launches: int, host_gap_s: float) -> list[float]:
    """Seconds to take the GIL back after dropping it, once per 'launch' (one small op)."""
    x, waits = torch.zeros(8), []
    for _ in range(launches):
        x.add_(1)
        start = time.perf_counter()
        time.sleep(0)  # drops the GIL and asks for it back at once
        waits.append(time.perf_counter() - start)
        time.sleep(host_gap_s)  # the rest of a step, waiting on the device without the GIL
    return waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vision-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--intervals-us", default="5000,200", help="Python switch intervals to try")
    ap.add_argument("--launches", type=int, default=400)
    ap.add_argument("--host-gap-ms", type=float, default=1.0)
    args = ap.parse_args()

    from rollplex.engines import recompute
    from scoring_setup import draw_responses, scoring_setup

    cfg, model, prompts, visions = scoring_setup(args.model, 1, args.new_tokens, args.vision_tokens, "cpu",
                                                 args.layers, "float32")
    responses = draw_responses(cfg, 1, model.config.get_text_config().vocab_size, torch.Generator().manual_seed(0),
                               capped=True)
    default = sys.getswitchinterval()
    # One intra-op thread: on a GPU host the training thread launches kernels rather than computing,
    # so the decode thread has a core of its own; here it gets the other one.
    torch.set_num_threads(1)
    print("checkpointing  switch µs  re-take median / p90 / p99 / max (ms)")
    for checkpointing in (False, True):
        if checkpointing:
            recompute.checkpoint_layers(model)
        for interval in (int(x) for x in args.intervals_us.split(",")):
            sys.setswitchinterval(interval / 1e6)
            stop, stepped = threading.Event(), threading.Event()
            trainer = threading.Thread(target=train_loop, args=(model, prompts, visions, responses, stop, stepped))
            trainer.start()
            stepped.wait()  # measure while training is under way (its loop never idles), not while it starts
            waits = sorted(w * 1e3 for w in retake_waits(args.launches, args.host_gap_ms / 1e3))
            stop.set()
            trainer.join()
            q = lambda f: waits[min(len(waits) - 1, int(f * len(waits)))]  # noqa: E731
            print(f"{str(checkpointing):13}  {interval:9}  {statistics.median(waits):.3f} / {q(0.9):.3f} / "
                  f"{q(0.99):.3f} / {waits[-1]:.3f}")
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
