"""The algorithms in dags/ against hand-computed values on fixed inputs.

Every expected number below was worked out by hand (the arithmetic is in the comments), not by
running the code under test.
"""
from __future__ import annotations

import math

import networkx as nx
import pytest
import torch

from rollplex.dags import dapo, grpo, ppo, reinforce_pp, rloo
from rollplex.pipeline.run.algorithms import builtin_algorithms, load_algorithm

T = torch.tensor


def close(actual, expected, tol=1e-4):
    assert torch.allclose(actual.float(), T(expected, dtype=torch.float32), atol=tol), (actual, expected)


# -- PPO ---------------------------------------------------------------------------------------------
def test_gae_matches_the_recursion_by_hand():
    """Row 0: 3 tokens, reward 1 on the last; row 1: 2 tokens, reward 2, a padding slot whose value
    (9.0) must be ignored.
    γ=0.9, λ=0.5, row 0, V=[.5,.6,.7]: δ2 = 1 − .7 = .3; δ1 = .9·.7 − .6 = .03; δ0 = .9·.6 − .5 = .04;
      A2 = .3, A1 = .03 + .45·.3 = .165, A0 = .04 + .45·.165 = .11425.
    row 1, V=[1, .5]: δ1 = 2 − .5 = 1.5; δ0 = .9·.5 − 1 = −.55; A1 = 1.5, A0 = −.55 + .45·1.5 = .125."""
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(ppo.gae(rewards, values, mask, gamma=0.9, lam=0.5), [[0.11425, 0.165, 0.3], [0.125, 1.5, 0.0]])


def test_gae_with_lambda_one_and_zero_values_is_the_return():
    # γ=λ=1, V=0: Â_t = Σ_{s≥t} r_s.
    close(ppo.gae(T([[1.0, 2.0, 3.0]]), torch.zeros(1, 3), torch.ones(1, 3), 1.0, 1.0), [[6.0, 5.0, 3.0]])


def test_ppo_token_rewards_carry_the_kl_penalty_and_the_final_reward():
    """kl_coef .1, old − ref = [.1,.2,.3] → r = [−.01, −.02, −.03 + 1]; V = 0, γ = λ = 1 → returns
    [.94, .95, .97]. Row 1 has 1 token and reward 0: −.1·.5 = −.05."""
    returns = ppo.gae_returns(rewards=T([1.0, 0.0]), old_values=torch.zeros(2, 3),
                              old_logprobs=T([[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]]),
                              ref_logprobs=T([[-1.1, -1.2, -1.3], [-2.5, 0.0, 0.0]]),
                              mask=T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), gamma=1.0, lam=1.0, kl_coef=0.1)
    close(returns, [[0.94, 0.95, 0.97], [-0.05, 0.0, 0.0]])


def test_ppo_returns_are_the_gae_advantages_plus_the_values():
    """The first row of the GAE case by hand (γ=.9, λ=.5, V=[.5,.6,.7], reward 1, no KL): Â =
    [.11425, .165, .3], so R = Â + V = [.61425, .765, 1.0]."""
    returns = ppo.gae_returns(rewards=T([1.0]), old_values=T([[0.5, 0.6, 0.7]]), old_logprobs=torch.zeros(1, 3),
                              ref_logprobs=torch.zeros(1, 3), mask=torch.ones(1, 3), gamma=0.9, lam=0.5, kl_coef=0.0)
    close(returns, [[0.61425, 0.765, 1.0]])


def test_ppo_advantages_are_whitened_over_the_batchs_response_tokens():
    """Two groups of one response ([P, G, R] = [2, 1, 2]); the second's last slot is padding (its
    return 9 must not count). Â = R − V = [1, 3 | 5]: mean 3, unbiased var (4 + 0 + 4)/2 = 4, std
    2, so whitened [−1, 0 | 1] and 0 on the padding. Unwhitened: R − V, padding 0."""
    returns, mask = T([[[1.5, 3.5]], [[5.5, 9.0]]]), T([[[1.0, 1.0]], [[1.0, 0.0]]])
    values = torch.full((2, 1, 2), 0.5)
    close(ppo.advantages(returns=returns, old_values=values, mask=mask), [[[-1.0, 0.0]], [[1.0, 0.0]]])
    close(ppo.advantages(returns=returns, old_values=values, mask=mask, whiten_advantages=False),
          [[[1.0, 3.0]], [[5.0, 0.0]]])
    assert load_algorithm("ppo").hyperparameters()["whiten_advantages"] is True  # on by default


def test_ppo_value_loss_is_clipped_around_the_old_values():
    """V = [1, 0], V_old = [.5, .5], returns R = [1, −.5]; clip .2 → [.7, .3].
    unclipped (V − R)² = [0, .25]; clipped = [.09, .64]; ½·max = [.045, .32]."""
    loss, metrics = ppo.value_loss(values=T([1.0, 0.0]), old_values=T([0.5, 0.5]), returns=T([1.0, -0.5]),
                                   clip_value=0.2)
    close(loss, [0.045, 0.32])
    close(metrics["value_loss"], [0.045, 0.32])


def test_ppo_policy_clip():
    # ratio e^{ln 1.5} = 1.5 with Â = 2: min(3, 1.2·2) = 2.4; ratio .5 with Â = −1: min(−.5, −.8) = −.8.
    loss, metrics = ppo.policy_loss(logprobs=T([[1.5, 0.5]]).log(), old_logprobs=torch.zeros(1, 2),
                                    ref_logprobs=torch.zeros(1, 2), advantages=T([[2.0, -1.0]]),
                                    rollout_is_weights=torch.ones(1, 2), clip_eps=0.2)
    close(loss, [[-2.4, 0.8]])
    close(metrics["clip_frac"], [[1.0, 1.0]])


# -- RLOO --------------------------------------------------------------------------------------------
def test_rloo_baseline_leaves_each_sample_out():
    # r = [1, 0, 0, 1]: others' mean for a 1 is 1/3 (Â = 2/3), for a 0 it is 2/3 (Â = −2/3).
    close(rloo.advantages(T([1.0, 0.0, 0.0, 1.0])), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # = G/(G−1)·(r − mean) on any input
    r = T([0.3, 1.7, -0.4])
    close(rloo.advantages(r), (1.5 * (r - r.mean())).tolist())


def test_rloo_gradient_is_advantage_times_score():
    logprobs = T([[-1.0, -2.0]], requires_grad=True)
    loss, _ = rloo.policy_loss(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=T([0.5]),
                               rollout_is_weights=torch.ones(1, 2))
    loss.sum().backward()
    close(logprobs.grad, [[-0.5, -0.5]])


# -- DAPO --------------------------------------------------------------------------------------------
def test_dapo_overlong_penalty():
    # L_max 8, L_cache 4: free up to 4 tokens, then −(|y| − 4)/4, at most −1.
    close(dapo.overlong_penalty(T([3.0, 4.0, 5.0, 7.0, 8.0, 9.0]), 8, 4), [0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    shaped = dapo.overlong_shaping(rewards=T([1.0, 1.0]), mask=T([[1.0] * 2 + [0.0] * 4, [1.0] * 6]),
                                   max_len=8, cache_len=4)
    close(shaped, [1.0, 0.5])


def test_dapo_dynamic_sampling_drops_all_equal_groups_and_renormalises():
    """Groups: [1,1] (6 tokens), [0,1] (6), [0,0] (4), [1,0] (2); 18 tokens. Groups 1 and 3 are
    informative: 8 tokens kept, weight 18/8 = 2.25. train_groups=1 keeps group 1 only: 18/6 = 3."""
    rewards = [T([1.0, 1.0]), T([0.0, 1.0]), T([0.0, 0.0]), T([1.0, 0.0])]
    mask = [T([[1.0, 1, 1], [1, 1, 1]]), T([[1.0, 1, 0, 0], [1, 1, 1, 1]]), T([[1.0, 1], [1, 1]]), T([[1.0], [1.0]])]
    keep = dapo.dynamic_sampling(rewards, mask)
    close(torch.stack(keep), [[0, 0], [2.25, 2.25], [0, 0], [2.25, 2.25]])
    close(torch.stack(dapo.dynamic_sampling(rewards, mask, train_groups=1)), [[0, 0], [3, 3], [0, 0], [0, 0]])
    # The runtime divides the summed per-token loss by all 18 tokens: with these weights that is the
    # mean over the 8 kept tokens.
    per_token = torch.cat([torch.nn.functional.pad(m, (0, 4 - m.shape[1])) for m in mask]) * 5.0
    weights = torch.cat(keep).unsqueeze(-1)
    assert float((per_token * weights).sum() / 18) == pytest.approx(5.0)
    assert dapo.dynamic_sampling([T([0.0, 0.0])], [T([[1.0], [1.0]])])[0].tolist() == [0.0, 0.0]


def test_dapo_clip_higher_is_asymmetric():
    # Â = +1, ratio 1.5 → clipped at 1.28; Â = −1, ratio .5 → clipped at .8: min(−.5, −.8) = −.8.
    loss, metrics = dapo.policy_loss(logprobs=T([[1.5, 0.5]]).log(), old_logprobs=torch.zeros(1, 2),
                                     advantages=T([1.0]), keep=T([1.0]), rollout_is_weights=torch.ones(1, 2))
    close(loss[0, :1], [-1.28])
    loss, _ = dapo.policy_loss(logprobs=T([[1.5, 0.5]]).log(), old_logprobs=torch.zeros(1, 2),
                               advantages=T([-1.0]), keep=T([2.0]), rollout_is_weights=torch.ones(1, 2))
    close(loss, [[1.5 * 2, 0.8 * 2]])  # −min(−1.5, −1.28) = 1.5; −min(−.5, −.8) = .8; weight 2
    # With Â = +1 the clip binds at ratio 1.5 (1.28 < 1.5) but not at .5: min(.5, .8) keeps the ratio.
    close(metrics["clip_frac"], [[1.0, 0.0]])


# -- the clip and the dual clip of every loss that clips --------------------------------------------------
# One token per response. Ratio r and advantage Â, clip ε = .2, dual clip c = 3; surrogate min(rÂ, clip(r)Â):
#   r 4, Â −1: min(−4, −1.2) = −4, loss 4; the dual clip raises it to max(−4, −3) = −3: loss 3, no gradient
#   r 2, Â −1: min(−2, −1.2) = −2 (−2 > −3: the dual clip does not bind)       loss 2, gradient −Â·r = 2
#   r .5, Â −1: min(−.5, −.8) = −.8, the clip binds                              loss .8, gradient 0
#   r 1.5, Â −1: min(−1.5, −1.2) = −1.5 (above the range, but the min keeps r)  loss 1.5, gradient 1.5
#   r .5, Â +1: min(.5, .8) = .5 (below the range, the min keeps r)              loss −.5, gradient −.5
#   r 1.5, Â +1: min(1.5, 1.2) = 1.2, the clip binds                             loss −1.2, gradient 0
#   r 1, Â +1: 1                                                                  loss −1, gradient −1
#   r 4, Â 0: 0 whatever the ratio                                                loss 0, gradient 0
RATIOS, ADVANTAGES = [4.0, 2.0, 0.5, 1.5, 0.5, 1.5, 1.0, 4.0], [-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 0.0]


def _clipping_loss(name, logprobs, advantages, **kw):
    """The algorithm's policy loss with its clip at .2 on both sides and (unless given) no KL term."""
    per_token = advantages.unsqueeze(-1)
    kw.setdefault("rollout_is_weights", torch.ones_like(logprobs))
    if name == "grpo":
        kw = {"ref_logprobs": logprobs.detach(), "kl_coef": 0.0, **kw}
        return grpo.policy_loss(logprobs=logprobs, old_logprobs=torch.zeros_like(logprobs), advantages=advantages,
                                **kw)
    if name == "dapo":
        return dapo.policy_loss(logprobs=logprobs, old_logprobs=torch.zeros_like(logprobs), advantages=advantages,
                                keep=torch.ones(len(advantages)), eps_high=0.2, **kw)
    module = ppo if name == "ppo" else reinforce_pp
    return module.policy_loss(logprobs=logprobs, old_logprobs=torch.zeros_like(logprobs),
                              ref_logprobs=torch.zeros_like(logprobs), advantages=per_token, **kw)


@pytest.mark.parametrize("name", ["grpo", "dapo", "ppo", "reinforce_pp"])
def test_the_clip_counts_where_it_binds_and_the_dual_clip_bounds_negative_advantages(name):
    for dual in (None, 3.0):
        logprobs = T(RATIOS).log().unsqueeze(-1).requires_grad_()
        loss, metrics = _clipping_loss(name, logprobs, T(ADVANTAGES), clip_ratio_c=dual)
        close(loss[:, 0], [3.0 if dual else 4.0, 2.0, 0.8, 1.5, -0.5, -1.2, -1.0, 0.0])
        close(metrics["clip_frac"][:, 0], [0, 0, 1, 0, 0, 1, 0, 0])
        # d loss / d log r = −Â·r where the surrogate is r·Â, 0 where a clip holds it
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        close(grad[:, 0], [0.0 if dual else 4.0, 2.0, 0.0, 1.5, -0.5, 0.0, -1.0, 0.0])
        if dual:
            close(metrics["dual_clip_frac"][:, 0], [1, 0, 0, 0, 0, 0, 0, 0])
        else:
            assert "dual_clip_frac" not in metrics


@pytest.mark.parametrize("name", ["grpo", "dapo", "ppo", "reinforce_pp"])
def test_rollout_is_weights_scale_the_policy_gradient_term_alone(name):
    """verl multiplies pg_losses by rollout_is_weights and adds the KL loss unweighted. Ratios 1.5
    and 1 with Â = +1: surrogate 1.2 (clipped) and 1; weights 2 and .5 → policy-gradient terms −2.4
    and −.5. GRPO's k3 to a reference at log π = 0 adds β·(1/1.5 + ln 1.5 − 1) and 0, unweighted."""
    logprobs = T([1.5, 1.0]).log().unsqueeze(-1)
    kl = 1 / 1.5 + math.log(1.5) - 1
    kw = {"kl_coef": 0.1, "ref_logprobs": torch.zeros_like(logprobs)} if name == "grpo" else {}
    loss, _ = _clipping_loss(name, logprobs, T([1.0, 1.0]), rollout_is_weights=T([[2.0], [0.5]]), **kw)
    close(loss[:, 0], [-2.4 + (0.1 * kl if name == "grpo" else 0.0), -0.5])


# -- REINFORCE++ -------------------------------------------------------------------------------------
def test_reinforce_pp_normalises_over_the_whole_batch():
    """Two prompts, all responses one token: rewards [[1, 1], [0, 0]]. Per-group normalisation would
    give 0 everywhere; over the batch: mean .5, unbiased std √(4·.25/3) = .57735 → ±.86603."""
    ones = torch.ones(2, 2, 1)
    adv = reinforce_pp.advantages(rewards=T([[1.0, 1.0], [0.0, 0.0]]), old_logprobs=torch.zeros(2, 2, 1),
                                  ref_logprobs=torch.zeros(2, 2, 1), mask=ones, kl_coef=0.0)
    close(adv, [[[0.86603], [0.86603]], [[-0.86603], [-0.86603]]])


def test_reinforce_pp_token_kl_and_discounted_return():
    """One 3-token response, reward 1, kl_coef .5, old − ref = [.2, .4, 0], γ = .5:
    r = [−.1, −.2, 1]; G = [−.1 + .5·.3, −.2 + .5·1, 1] = [.05, .3, 1]; mean .45, deviations
    [−.4, −.15, .55], unbiased var .485/2 = .2425, std .492443 → [−.81228, −.30460, 1.11688]."""
    adv = reinforce_pp.advantages(rewards=T([[1.0]]), old_logprobs=T([[[0.2, 0.4, 0.0]]]),
                                  ref_logprobs=torch.zeros(1, 1, 3), mask=torch.ones(1, 1, 3), kl_coef=0.5, gamma=0.5)
    close(adv, [[[-0.81228, -0.30460, 1.11688]]])


def test_reinforce_pp_ignores_padding():
    # Row 0: 2 tokens, reward 1 → G = [1, 1]; row 1: 1 token, reward 0 → G = [0]; padding excluded:
    # mean 2/3, unbiased std √((1/9 + 1/9 + 4/9)/2) = .57735 → [.57735, .57735], [−1.1547, 0 (pad)].
    adv = reinforce_pp.advantages(rewards=T([[1.0, 0.0]]), old_logprobs=torch.zeros(1, 2, 2),
                                  ref_logprobs=torch.zeros(1, 2, 2), mask=T([[[1.0, 1.0], [1.0, 0.0]]]), kl_coef=0.0)
    close(adv, [[[0.57735, 0.57735], [-1.1547, 0.0]]])


# -- all of them ---------------------------------------------------------------------------------------
def test_every_algorithm_is_built_in_and_uses_only_the_public_api():
    import ast
    from pathlib import Path

    import rollplex.dags

    assert {"grpo", "ppo", "rloo", "dapo", "reinforce_pp"} <= set(builtin_algorithms())
    for name in ("grpo", "ppo", "rloo", "dapo", "reinforce_pp"):
        alg = load_algorithm(name)
        assert alg.name == name and alg.doc
        source = (Path(rollplex.dags.__file__).parent / f"{name}.py").read_text()
        imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = {n.module for n in imports if isinstance(n, ast.ImportFrom)} | {a.name for n in imports
                                                                                  if isinstance(n, ast.Import)
                                                                                  for a in n.names}
        assert modules <= {"torch", "rollplex"}, (name, modules)
        assert len(source.splitlines()) <= 90, f"{name}.py is more than about a page"
    assert grpo.algorithm.trainable == ["actor"]
    assert ppo.algorithm.trainable == ["actor", "critic"]


@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "dapo", "reinforce_pp"])
def test_every_algorithm_compiles_under_both_schedules(name):
    """Serial barriers put grad forwards in the training phase, unless the advantage reads them (PPO's
    critic values, REINFORCE++'s old log-probs): then they stay in scoring, or the barrier would be a
    cycle. Each trained model gets its own losses and optimizer step; only the policy is synced."""
    from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
    from rollplex.pipeline.plan.schedule import schedule

    alg = load_algorithm(name)
    choice = EngineChoice({"decode": "vllm", "train": "torch", "score": "transformers"})
    for sharing in (True, False):
        graph = compile_iteration(alg, BatchShape(4, 4, 8, 4, micro_batch_groups=2, prefix_sharing=sharing), choice,
                                  ModelDims(128, 2, 2, 32, 600, 10**6))
        for policy in ("serial", "rollplex"):
            schedule(graph, policy).lint()
        steps = {n.model for n in graph.of_kind("optimizer_step")}
        assert steps == set(alg.trainable)
        assert {n.model for n in graph.of_kind("loss")} == steps
        assert [n.model for n in graph.of_kind("weight_sync")] == ["actor"]
    if name == "ppo":  # the critic's prefix is scheduled like the reference's: in the decode window
        graph = schedule(compile_iteration(alg, BatchShape(4, 4, 8, 4, micro_batch_groups=2), choice,
                                           ModelDims(128, 2, 2, 32, 600, 10**6)), "rollplex")
        assert {n.model for n in graph.of_kind("prefix")} == {"actor", "ref", "critic"}
        decode = {n.name for n in graph.of_kind("decode_chunk")}
        for node in graph.of_kind("prefix"):  # nothing orders it after decode: it runs beside it
            assert not nx.ancestors(graph.g, node.name) & decode, node.name


# -- end to end, in process (hf decode, torch AdamW; the Dask path runs in the measured runs) ------------
WARMUP_STEPS = 12


@pytest.fixture(scope="module")
def warmed_model(tmp_path_factory):
    """The embedded model after a short answer-format warm-up (random valid answers: reward at
    chance), so that groups hold both rewards and every algorithm has a gradient to follow."""
    from rollplex.pipeline.run.hostops import _warmup

    out = tmp_path_factory.mktemp("warmed")
    session, host, _ = _host(out, "grpo", model_path=None)
    try:
        for step in range(WARMUP_STEPS):
            _warmup(host, 0, step, 16, 3e-3)
        host.train_engine("actor").module.save_pretrained(out / "model")
        session.processor.save_pretrained(out / "model")
    finally:
        host.close()
    return out / "model"


def _host(tmp_path, algorithm: str, *extra: str, model_path=None):
    from rollplex.config import load_config
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    if model_path is not None:
        extra = (*extra, f"model.path={model_path}")
    cfg = load_config(None, ["seed=1", "warmup.steps=0", "stop_at_reward=null", "engines.decode=hf",
                             "engines.train=torch", "rollout.prompts_per_iteration=4",
                             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
                             f"algorithm={algorithm}", *extra])
    session = Session(cfg, tmp_path / algorithm.replace("/", "_"))
    host = WorkerHost(session.host_spec(), name="local")
    return session, host, LocalExecutor(host)


def _iterate(session, executor, iterations: int) -> list[dict]:
    reports = []
    for iteration in range(iterations):
        batch = session.loader.next_batch()
        result = executor.run(session.graph, iteration, {f"prompt_p{p}": x for p, x in enumerate(batch)})
        reports.append(result.output["report"])
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppo", "rloo", "dapo", "reinforce_pp"])
def test_each_algorithm_runs_two_iterations_and_updates_its_models(tmp_path, warmed_model, name):
    session, host, executor = _host(tmp_path, name, model_path=warmed_model)
    try:
        trained = host.algorithm.trainable
        before = {m: {k: v.clone() for k, v in host.train_engine(m).module.named_parameters() if v.requires_grad}
                  for m in trained}
        reports = _iterate(session, executor, 2)
        assert any(0 < r["metrics"]["reward_mean"] < 1 for r in reports)  # something to learn from
        for report in reports:
            metrics = report["metrics"]
            assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
            assert len(report["rows"]) == 16
        for m in trained:  # every trained model took a step (one with a nonzero gradient)
            after = dict(host.train_engine(m).module.named_parameters())
            assert any(not torch.equal(before[m][k], after[k]) for k in before[m]), m
        if name == "ppo":
            assert "loss_critic" in metrics and "value_loss" in metrics and "grad_norm_critic" in metrics
            assert len(reports[-1]["rows"][0]["old_values"]) == len(reports[-1]["rows"][0]["response_token_ids"])
        if name == "dapo":
            assert 0.0 <= metrics["kept"] <= 1.0
    finally:
        host.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "dapo", "reinforce_pp"])
def test_each_algorithm_takes_several_steps_per_iteration_and_its_clip_binds(tmp_path, warmed_model, name):
    """train.mini_batches 2 × train.epochs 2: four steps per trained model in one iteration. After the
    first, a mini-batch's ratio to the rollout-time policy leaves 1, so the losses that clip do."""
    session, host, executor = _host(tmp_path, name, "train.mini_batches=2", "train.epochs=2",
                                    "train.micro_batch_groups=1", model_path=warmed_model)
    try:
        trained = host.algorithm.trainable
        before = {m: {k: v.clone() for k, v in host.train_engine(m).module.named_parameters() if v.requires_grad}
                  for m in trained}
        (report,) = _iterate(session, executor, 1)
        metrics = report["metrics"]
        assert 0 < metrics["reward_mean"] < 1
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
        for m in trained:
            after = dict(host.train_engine(m).module.named_parameters())
            assert any(not torch.equal(before[m][k], after[k]) for k in before[m]), m
        if name != "rloo":  # RLOO weights by the ratio without a clip
            assert metrics["clip_frac"] > 0
        if name == "dapo":  # the informative groups' share of the tokens, averaged over both epochs' visits
            rows = report["rows"]
            groups = [rows[i:i + 4] for i in range(0, len(rows), 4)]
            tokens = [sum(len(r["response_token_ids"]) for r in g) for g in groups]
            kept = sum(t for g, t in zip(groups, tokens) if len({r["reward"] for r in g}) > 1)
            assert metrics["kept"] == pytest.approx(kept / sum(tokens))
    finally:
        host.close()


@pytest.mark.slow
def test_train_clip_ratio_c_sets_the_dual_clip_of_the_loss(tmp_path, warmed_model):
    """Without train.clip_ratio_c the loss has no dual clip to report; with it, the loss runs with it
    (the dual clip rarely binds: a later step mostly lowers a negative-advantage token's ratio)."""
    steps = ("train.mini_batches=2", "train.epochs=2", "train.micro_batch_groups=1")
    for extra, on in (((), False), (("train.clip_ratio_c=2.5",), True)):
        session, host, executor = _host(tmp_path / str(on), "grpo", *steps, *extra, model_path=warmed_model)
        try:
            (report,) = _iterate(session, executor, 1)
            assert host.spec.settings.params.get("clip_ratio_c") == (2.5 if on else None)
        finally:
            host.close()
        assert ("dual_clip_frac" in report["metrics"]) == on


@pytest.mark.slow
def test_ppo_checkpoint_holds_the_critic_and_restores_it(tmp_path, warmed_model):
    import os

    from rollplex.pipeline.run.hostops import _load, _save

    session, host, executor = _host(tmp_path, "ppo", model_path=warmed_model)
    try:
        _iterate(session, executor, 1)
        _save(host, str(tmp_path / "ckpt"), {os.getpid()})
        assert (tmp_path / "ckpt" / "critic" / "model.safetensors").exists()
        critic = host.train_engine("critic").module
        saved = {k: v.clone() for k, v in critic.state_dict().items()}
        _iterate(session, executor, 1)
        assert any(not torch.equal(saved[k], v) for k, v in critic.state_dict().items())
        _load(host, str(tmp_path / "ckpt"))
        assert all(torch.equal(saved[k], v) for k, v in critic.state_dict().items())
        assert critic.lm_head.weight.shape[0] == 1  # still the value head
    finally:
        host.close()


@pytest.mark.slow
def test_ppo_value_loss_falls_as_the_critic_learns(tmp_path, warmed_model):
    """The same 4 prompts every iteration, fresh samples each time, λ = 1 and no KL: the returns are
    the rewards. The critic (zero at first) first learns the mean reward, then each prompt's; its loss
    falls well below where it stood while it knew only the mean (measured: ~.11 → ~.04 by iteration 30)."""
    # The actor's advantages unwhitened, as when this curve was measured: the critic's loss drops late
    # (iterations ~25-30) and whitening moves which responses it sees; whitened it fell to .063 by
    # iteration 30, two iterations behind, with the same rewards (.44-.5 from iteration 12 on in both).
    session, host, executor = _host(tmp_path, "ppo", "params.kl_coef=0.0", "params.lam=1.0",
                                    "params.whiten_advantages=false", model_path=warmed_model)
    try:
        batch = session.loader.next_batch()
        losses = []
        for iteration in range(30):
            result = executor.run(session.graph, iteration, {f"prompt_p{p}": x for p, x in enumerate(batch)})
            losses.append(result.output["report"]["metrics"]["loss_critic"])
        assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[1:6]) / 5, losses
    finally:
        host.close()


def test_group_normalised_advantages_refuse_one_sample_and_the_others_take_it():
    """GRPO's and DAPO's advantage divides by the group's std, NaN for G = 1 (the run would stop at
    its first step, exit 3); RLOO (zero baseline), PPO (GAE) and REINFORCE++ (batch-normalised) are
    defined there, and GRPO with G = 2 is fine."""
    from rollplex.errors import ConfigError
    from rollplex.pipeline.run.session import check_group_size

    assert torch.isnan(grpo.advantages(T([1.0]))).all()  # what the refusal spares the run
    for name in ("grpo", "dapo"):
        with pytest.raises(ConfigError, match=rf"rollout.samples_per_prompt: 1 is too few for {name}"):
            check_group_size(load_algorithm(name), 1)
        check_group_size(load_algorithm(name), 2)
    for name in ("rloo", "ppo", "reinforce_pp"):
        check_group_size(load_algorithm(name), 1)
    close(rloo.advantages(T([0.7])), [0.7])
