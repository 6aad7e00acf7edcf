"""Weight sharing across two real TP ranks: one process per GPU (torch.multiprocessing spawn, NCCL;
gloo on CPU for a dry run), checking that the rollout layout built on each GPU's trainer storage
gives the training model's forward, before and after an optimizer step.

Per (t_train, t_roll) over the two GPUs and per rollout engine kind (fused like vLLM, or not):
each rank allocates only its own trainer shard; the plan's aliases are views of it (checked by
data_ptr on the device); rows that live on the peer arrive by an all-gather of the trainer buffers.
The rollout shards are then gathered to rank 0, whose TP forward (column shards concatenated, row
shards summed) must equal the HF model's forward. After one AdamW step on every rank's shard, a
refresh copies only what is not aliased, and the forward is checked again.

    python benchmarks/weightshare_tp.py --out weightshare_tp.json               # 2 GPUs, ~1 min
    python benchmarks/weightshare_tp.py --device cpu --out /tmp/tp.json --layers 1 --hidden 128   # dry run
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, args, port: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollplex.engines.sharing import Gang, TextDims, inside, tp_forward
    from rollplex.engines.modelspec import VLMSpec
    from rollplex.engines.tensorlayouts import actor_layouts
    from rollplex.pipeline.plan.weightshare import RolloutSide, TrainerSide, plan_gang

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=2)
    heads, kv, d = args.heads, args.kv_heads, args.hidden // args.heads
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv,
                      tie_word_embeddings=False, max_position_embeddings=256)
    spec = VLMSpec("tp-check", args.hidden, args.layers, heads, kv, d, args.intermediate, args.vocab, False)
    lays = actor_layouts(spec)
    ids = torch.randint(0, args.vocab, (args.seq,), generator=torch.Generator().manual_seed(1)).to(device)
    dims = TextDims(args.layers, heads, kv, d, args.vocab, cfg.rms_norm_eps)
    with torch.no_grad():
        rotary = Qwen2ForCausalLM(cfg).model.rotary_emb.to(device)
        positions = torch.arange(args.seq, device=device)[None]
        cos, sin = rotary(torch.zeros(1, args.seq, args.hidden, device=device), positions)

    def canonical(tensors):
        return {(k[6:] if k.startswith("model.") else k): v.detach() for k, v in tensors}

    def exchange(buffers):
        """All-gather every trainer buffer (same size on both ranks for a given tensor)."""
        mine = buffers[rank]
        out = [{} for _ in range(2)]
        for name in sorted(mine):
            parts = [torch.empty_like(mine[name]) for _ in range(2)]
            dist.all_gather(parts, mine[name].contiguous())
            for r in range(2):
                out[r][name] = parts[r]
        return out

    def rollout_forward(gang):
        """Rank 0: the TP forward over every rollout rank's shards, gathered from the GPUs."""
        names = sorted(gang.rollout[rank])
        shards = [{} for _ in range(2)]
        for n in names:
            parts = [torch.empty_like(gang.rollout[rank][n].contiguous()) for _ in range(2)]
            dist.all_gather(parts, gang.rollout[rank][n].contiguous())
            for r in range(2):
                shards[r][n] = parts[r]
        lays_by = gang.layouts

        def split(name, r):
            return [x for _, _, x in lays_by[name].shard_rows(gang.tr, r)]

        with torch.no_grad():
            return tp_forward(dims, ids, cos, sin, gang.tr, lambda r, n: shards[gang.rank_gpu("roll", r)][n],
                              gang.plan.rollout.fused, split)

    rows = []
    for tt, tr in ((1, 2), (2, 1), (2, 2)):
        for fused in (True, False):
            torch.manual_seed(0)
            ref_model = Qwen2ForCausalLM(cfg).float().to(device).eval()
            plan = plan_gang(lays, TrainerSide(tt, "float32"), RolloutSide(tr, "float32", fused=fused))
            gang = Gang(lays, plan, canonical(ref_model.state_dict().items()), device, [rank], exchange)
            mine = plan.gpus[rank]
            for dcs in mine.decisions:  # aliases are views of this GPU's trainer storage
                t, buf = gang.rollout[rank][dcs.tensor], gang.buffers[rank][dcs.tensor]
                assert inside(t, buf) == (dcs.kind in ("alias", "inplace")), dcs
            with torch.no_grad():
                ref = ref_model(ids[None]).logits[0]
            before = rollout_forward(gang)
            # One AdamW step: HF on the full model; each rank on its own shard, gradients sliced alike.
            ref_model.train()
            ref_model(ids[None], labels=ids[None]).loss.backward()
            ref_model.eval()
            grads = Gang(lays, plan, canonical((k, p.grad) for k, p in ref_model.named_parameters()), device,
                         [rank], exchange)
            torch.optim.AdamW(ref_model.parameters(), lr=1e-2).step()
            views = gang.train_params[rank]
            for key, v in views.items():
                v.grad = grads.train_params[rank][key].clone()
            torch.optim.AdamW(list(views.values()), lr=1e-2, foreach=False).step()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            moved = gang.refresh()
            if cuda:
                torch.cuda.synchronize()
            refresh_s = time.perf_counter() - t0
            after = rollout_forward(gang)
            with torch.no_grad():
                ref_after = ref_model(ids[None]).logits[0]
            row = {"t_train": tt, "t_roll": tr, "fused": fused,
                   "aliased_bytes": mine.total("aliased"), "copied_bytes": mine.total("local"),
                   "gathered_bytes": mine.total("gathered"), "refresh_moved": moved, "refresh_s": refresh_s,
                   "max_diff_before": float((before - ref).abs().max()),
                   "max_diff_after": float((after - ref_after).abs().max()),
                   "changed_by_step": float((ref_after - ref).abs().max())}
            if rank == 0:
                rows.append(row)
                print(f"t_train={tt} t_roll={tr} {'fused' if fused else 'unfused':7s}: rank 0 aliases "
                      f"{row['aliased_bytes'] / 2**20:7.1f} MiB, copies {row['copied_bytes'] / 2**20:6.1f} MiB, "
                      f"gathers {row['gathered_bytes'] / 2**20:6.1f} MiB; |rollout - HF| {row['max_diff_before']:.1e} "
                      f"before, {row['max_diff_after']:.1e} after the step (which moved logits by "
                      f"{row['changed_by_step']:.1e}); refresh {refresh_s * 1e3:.1f} ms", flush=True)
                ok = row["max_diff_before"] < args.tol and row["max_diff_after"] < args.tol
                if not ok:
                    raise SystemExit(f"rollout forward differs from the training forward: {row}")
    if rank == 0:
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.out, json.dumps({"rows": rows, "args": vars(args)}, indent=1))
        print(f"all pairs match (tolerance {args.tol}); wrote {args.out}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.multiprocessing as tmp

    tmp.spawn(worker, args=(args, _port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
