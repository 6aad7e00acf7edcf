"""The ``plain`` policy: a GRPO iteration as a careful user writes it with transformers and torch.

The reference every bench ratio is also printed against ("today's serial runtimes"). Rollout runs on
the bench's decode engine with the runtime's request ids and seeds, so it samples what ``serial``
samples; everything after it is plain transformers/torch calls, no Rollplex task code:

- the vision tower once per prompt (it is frozen), its output reused by the prompt's G sequences;
- reference log-probs, then the policy's forward with grad, loss and backward, over full sequences
  (prompt + response) in micro-batches of ``seq`` sequences, right-padded, each micro-batch's graph
  freed by its backward before the next forward; logits only at the response positions;
- GRPO's group-normalised advantage, clipped surrogate and k3 KL (dags/grpo.py's defaults),
  token-mean over the batch; gradient clipping and the engine's torch AdamW; the decode engine's
  weights refreshed as the runtime's weight sync does.

It returns what the runtime's executors return (``IterationResult``), with one trace event per
phase named after the node kind that does that work, so the bench reports it like any policy.
"""
from __future__ import annotations

import time
from typing import Any

import torch

CLIP_EPS, KL_COEF, ADV_EPS = 0.2, 0.04, 1e-6  # dags/grpo.py's defaults


def caps_of(prompt, cfg) -> list[int]:
    """Each sample's length cap: the bench's long-tailed draw in the prompt's meta, else the batch's."""
    return list(prompt.meta.get("max_tokens") or [cfg.max_new_tokens] * cfg.samples)


class PlainExecutor:
    def __init__(self, cfg, actor, ref, decode, reward, sequences: int = 0) -> None:
        self.cfg, self.actor, self.ref, self.decode, self.reward = cfg, actor, ref, decode, reward
        self.model = actor.module
        self.sequences = sequences or cfg.samples  # per forward and backward: one group by default
        self.device = next(self.model.parameters()).device

    # -- one iteration ----------------------------------------------------------------------------
    def run(self, graph, iteration: int, inputs: dict[str, Any]):
        from rollplex.pipeline.run.worker import IterationResult, alloc_retries_since_drain

        prompts = [inputs[k] for k in sorted(inputs, key=lambda k: int(k.rsplit("p", 1)[1]))]
        events: list[dict] = []
        cuda = self.device.type == "cuda"
        if cuda:
            alloc_retries_since_drain(self.device)  # from here on, as a runtime host counts an iteration's
        start = time.time()

        def phase(kind: str, fn, *args):
            t = time.time()
            out = fn(*args)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            events.append({"name": f"plain_{kind}", "cat": kind, "ph": "X", "ts": t * 1e6,
                           "dur": (time.time() - t) * 1e6, "pid": "plain", "tid": "main", "args": {}})
            return out

        vision = phase("vit_encode", self.vision, prompts)
        responses = phase("decode_chunk", self.rollout, prompts, vision, iteration)
        rewards = torch.tensor([[self.reward(" ".join(map(str, r)), p.answer) for r in group]
                                for p, group in zip(prompts, responses)])
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + ADV_EPS)
        rows = [(p, g) for p in range(len(prompts)) for g in range(len(responses[p]))]
        batches = [rows[i: i + self.sequences] for i in range(0, len(rows), self.sequences)]
        tokens = sum(len(responses[p][g]) for p, g in rows)
        ref = phase("suffix_score", lambda: [self.logprobs(self.ref.model, prompts, vision, responses, b, grad=False)
                                              for b in batches])
        loss = phase("loss", self.train, prompts, vision, responses, batches, ref, advantages, tokens)
        grad_norm = phase("optimizer_step", self.step)
        phase("weight_sync", lambda: self.decode.load_weights(self.actor.state_dict_for_sync(trainable_only=True)))
        seconds = time.time() - start
        report = {"rows": [{"prompt_id": prompts[p].prompt_id, "response_token_ids": responses[p][g],
                            "reward": float(rewards[p, g]), "advantage": float(advantages[p, g])} for p, g in rows],
                  "metrics": {"reward_mean": float(rewards.mean()), "loss": loss, "grad_norm": grad_norm,
                              "response_len_mean": tokens / max(len(rows), 1)}}
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        retries = alloc_retries_since_drain(self.device) if cuda else 0
        return IterationResult({"report": report}, events, int(peak), seconds, started=start, alloc_retries=int(retries))

    # -- the phases -------------------------------------------------------------------------------
    @torch.no_grad()
    def vision(self, prompts) -> list[torch.Tensor]:
        """Each prompt's merged vision output (its images', in order), once per prompt."""
        core = self.model.model
        return [torch.cat(list(core.get_image_features(p.pixel_values.to(self.device),
                                                       p.image_grid_thw.to(self.device)).pooler_output))
                for p in prompts]

    def rollout(self, prompts, vision, iteration: int) -> list[list[list[int]]]:
        from rollplex.engines.base import DecodeRequest
        from rollplex.tasks.nodes import request_id, sample_seed  # the runtime's ids and seeds: the same samples

        requests = []
        for p, (prompt, vis) in enumerate(zip(prompts, vision)):
            base = dict(prompt_token_ids=prompt.input_ids.tolist(), image_embeds=vis, image_grid_thw=prompt.image_grid_thw,
                        temperature=1.0, top_p=1.0)
            seed = sample_seed(self.cfg.seed, iteration, prompt.prompt_id)
            caps = caps_of(prompt, self.cfg)
            requests += [DecodeRequest(f"{request_id(iteration, p)}/{g}", max_tokens=int(cap), seed=seed + g, n=1, **base)
                         for g, cap in enumerate(caps)]
        self.decode.add_requests(requests)
        done = {}
        while self.decode.has_unfinished():
            for seq in self.decode.step(self.cfg.chunk_tokens):
                done[seq.request_id] = seq.token_ids
        return [[done[f"{request_id(iteration, p)}/{g}"] for g in range(len(caps_of(prompt, self.cfg)))]
                for p, prompt in enumerate(prompts)]

    def logprobs(self, model, prompts, vision, responses, batch, grad: bool) -> torch.Tensor:
        """Per-token log-probs of the batch's responses, concatenated in batch order, from one padded
        full-sequence forward of ``model``'s language model on the prompts' vision output."""
        lm, config = model.model.language_model, model.config
        seqs = [torch.cat([prompts[p].input_ids, torch.tensor(responses[p][g], dtype=torch.long)]) for p, g in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        positions = torch.zeros(3, len(seqs), width, dtype=torch.long)
        for b, ((p, _), s) in enumerate(zip(batch, seqs)):
            ids[b, : len(s)] = s
            prompt = prompts[p].input_ids.view(1, -1)
            types = (prompt == config.image_token_id).int()
            pos, delta = model.model.get_rope_index(prompt, mm_token_type_ids=types,
                                                   image_grid_thw=prompts[p].image_grid_thw)
            n = prompt.shape[1]
            positions[:, b, :n] = pos[:, 0]
            positions[:, b, n: len(s)] = torch.arange(n, len(s)) + int(delta.view(-1)[0])
        ids, positions = ids.to(self.device), positions.to(self.device)
        with torch.set_grad_enabled(grad):
            embeds = lm.embed_tokens(ids)
            for b, (p, _) in enumerate(batch):  # the prompt's image pads (a response may sample that id too)
                at = (prompts[p].input_ids == config.image_token_id).nonzero().view(-1).to(self.device)
                embeds[b, at] = vision[p].to(embeds.dtype)
            # Rows are right-padded and attention is causal, so no real token sees a pad: without a
            # padding mask SDPA runs its causal flash kernel rather than the masked one.
            hidden = lm(inputs_embeds=embeds, position_ids=positions).last_hidden_state
            n = [len(prompts[p].input_ids) for p, _ in batch]
            picked = torch.cat([hidden[b, n[b] - 1: len(s) - 1] for b, s in enumerate(seqs)])
            targets = torch.cat([s[n[b]:] for b, s in enumerate(seqs)]).to(self.device)
            logits = model.lm_head(picked).float()
            return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]

    def train(self, prompts, vision, responses, batches, ref, advantages, tokens: int) -> float:
        total = 0.0
        for batch, ref_lp in zip(batches, ref):
            logp = self.logprobs(self.model, prompts, vision, responses, batch, grad=True)
            old = logp.detach()  # one step per rollout: the rollout-time policy is this one
            adv = torch.cat([advantages[p, g].expand(len(responses[p][g])) for p, g in batch]).to(logp.device)
            ratio = torch.exp(logp - old)
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
            log_ratio = ref_lp - logp
            kl = torch.exp(log_ratio) - log_ratio - 1
            loss = -(surrogate - KL_COEF * kl).sum() / tokens  # token-mean over the whole batch
            loss.backward()
            total += float(loss.detach())
        return total

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.actor.grad_clip) if params else torch.zeros(())
        self.actor.optimizer.step()
        self.actor.optimizer.zero_grad(set_to_none=True)
        return float(norm)
