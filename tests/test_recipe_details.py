"""The implementation details of the published RLHF recipes (book/guide_algorithms.md, "Details
of the published recipes"): OpenAI 2019 (lm-human-preferences), N+ (TL;DR) and the 37 PPO
details. Each test names the detail it backs."""

import json
from pathlib import Path
import math

import pytest
import torch

from conftest import small_config
from ppo_lab.masked import masked_whiten, response_mask
from ppo_lab.objective import Objective
from ppo_lab.rewards import SequenceClassifierReward, encode_pairs, sequence_scores
from ppo_lab.sampling import Sampling, generate
from ppo_lab.shaping import adjust_scores, reference_normalization, shape_rewards
from ppo_lab.trainer import PPOTrainer

# --- the truncation window (OpenAI 2019: a period at response position >= 16) ------------------


def _slow_window_mask(ids: list[int], stops: set[int], after: int) -> list[float]:
    out, done = [], False
    for t, token in enumerate(ids):
        out.append(0.0 if done else 1.0)
        if token in stops and t >= after:
            done = True
    return out


@pytest.mark.parametrize("after", [0, 1, 3, 6])
def test_response_mask_window_against_a_loop(after):
    g = torch.Generator().manual_seed(after)
    ids = torch.randint(0, 5, (40, 7), generator=g)
    got = response_mask(ids, [1, 3], stop_after=after)
    want = torch.tensor([_slow_window_mask(row, {1, 3}, after) for row in ids.tolist()])
    assert torch.equal(got, want)


def test_window_decides_where_a_response_ends_not_what_is_sampled(tiny_path):
    """With the same draws, a response cut by the window is a prefix of the uncut one: the
    window changes no logit, so the sampled tokens (and the PPO ratio) are those of the policy."""
    from ppo_lab.models import load_policy, load_tokenizer

    tok, lm = load_tokenizer("builtin:tiny"), load_policy("builtin:tiny")
    prompts = ["the movie was", "this food is", "the story is"] * 4
    u = torch.rand(len(prompts), 10, generator=torch.Generator().manual_seed(0))
    period = tok.convert_tokens_to_ids(".")
    full = generate(lm, tok, prompts, Sampling(max_new_tokens=10), uniforms=u)
    cut = generate(lm, tok, prompts, Sampling(max_new_tokens=10, stop_ids=(tok.eos_token_id, period), stop_after=3), uniforms=u)
    early = 0
    for i in range(len(prompts)):
        n = int(cut.mask[i].sum())
        assert torch.equal(cut.response_ids[i, :n], full.response_ids[i, :n])
        stops = [t for t in range(n) if int(cut.response_ids[i, t]) in (tok.eos_token_id, period)]
        early += any(t < 3 for t in stops)
        assert cut.ended[i] == (stops[-1:] != [] and stops[-1] == n - 1 and n - 1 >= 3)
    assert early > 0  # the case under test happened: a stop token before the window was kept


def test_stop_after_is_checked():
    with pytest.raises(ValueError, match=r"stop_after = 8 leaves no position"):
        small_config(Path("."), {"sampling.stop_after": 8})
    with pytest.raises(ValueError, match=r"sampling.stop_after = 4 leaves no position where a response could stop \(max_new_tokens = 4\)"):
        Sampling(max_new_tokens=4, stop_after=4)


# --- the score of a response without EOS, and the fixed reference normalisation ---------------


def test_a_missing_eos_rule_with_ignore_eos_is_refused():
    with pytest.raises(ValueError, match="ignore_eos never lets a response stop"):
        small_config(Path("."), {"sampling.ignore_eos": True, "reward.truncated_score": -1.0})


def test_missing_eos_score_replaces_and_penalty_subtracts():
    scores, eos = torch.tensor([0.5, 2.0, -3.0]), torch.tensor([True, False, False])
    assert adjust_scores(scores, eos, truncated_score=-1.0).tolist() == [0.5, -1.0, -1.0]
    assert adjust_scores(scores, eos, truncated_penalty=1.0).tolist() == [0.5, 1.0, -4.0]
    # the gain and bias come first; the replacement is on the normalised scale
    assert adjust_scores(scores, eos, truncated_score=-1.0, gain=2.0, bias=1.0).tolist() == [2.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="not both"):
        adjust_scores(scores, eos, truncated_penalty=1.0, truncated_score=-1.0)
    with pytest.raises(ValueError, match="set one of them"):
        small_config(Path("."), {"reward.truncated_penalty": 1.0, "reward.truncated_score": -1.0})


@pytest.mark.parametrize("mode", ["mean-std", "mean"])
def test_reference_normalization_against_the_formula(mode):
    s = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 4 + 7
    gain, bias = reference_normalization(s, mode)
    mapped = [gain * x + bias for x in s.tolist()]
    mean = sum(mapped) / len(mapped)
    std = math.sqrt(sum((x - mean) ** 2 for x in mapped) / (len(mapped) - 1))
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert std == pytest.approx(1.0 if mode == "mean-std" else float(s.double().std()), rel=1e-6)
    with pytest.raises(ValueError, match="all equal"):
        reference_normalization(torch.ones(4))
    with pytest.raises(ValueError, match="nan or inf"):
        reference_normalization(torch.tensor([1.0, float("nan")]))


def test_reference_score_norm_is_fitted_once_and_resumed(tiny_path, tmp_path, monkeypatch):
    cfg = small_config(tmp_path, {
            "reward.reference_norm": "mean-std", "reward.reference_samples": 32, "run.save_interval": 1,
            "run.eval_interval": 1,
        })
    trainer = PPOTrainer(cfg)
    ref = trainer.reference_scores(32)
    assert float((ref * trainer.score_gain + trainer.score_bias).mean()) == pytest.approx(0.0, abs=1e-5)
    assert float((ref * trainer.score_gain + trainer.score_bias).std()) == pytest.approx(1.0, rel=1e-4)
    assert trainer.score_gain != 1.0
    trainer.train(1)
    ro = trainer.rollout(trainer.next_prompts())  # the map reaches the rewards: score at the last token
    rewards, _, _ = trainer.advantages(ro)
    want = shape_rewards(ro.scores * trainer.score_gain + trainer.score_bias, ro.old_logprobs, ro.ref_logprobs, ro.mask, trainer.kl_ctl.value)
    assert torch.allclose(rewards, want, atol=1e-6)
    monkeypatch.setattr(PPOTrainer, "reference_scores", lambda self, n: pytest.fail("a resumed run refitted the normalisation"))
    resumed = PPOTrainer(small_config(tmp_path, {"reward.reference_norm": "mean-std", "reward.reference_samples": 32, "run.resume_from": "latest"}))
    assert (resumed.score_gain, resumed.score_bias) == (trainer.score_gain, trainer.score_bias)
    for other in ("none", "mean"):
        with pytest.raises(ValueError, match=f"trained with reward.reference_norm = 'mean-std', this run asks for '{other}'"), pytest.warns(UserWarning):
            PPOTrainer(small_config(tmp_path, {"reward.reference_norm": other, "run.resume_from": "latest"}))


def test_reference_prompts_are_drawn_at_random(tiny_path, tmp_path, monkeypatch):
    seen = []
    trainer = PPOTrainer(small_config(tmp_path), train_prompts=[f"the movie was {w}" for w in ("good", "bad", "fun", "dull", "long")], reward_fn=lambda p, r: [len(x) for x in r])
    monkeypatch.setattr(trainer, "score", lambda prompts, responses, drawn: seen.append(prompts) or torch.zeros(len(prompts)))
    assert trainer.reference_scores(7).shape == (7,)
    assert sorted(seen[0][:5]) == sorted(trainer.train_prompts)  # each prompt once before any twice
    assert seen[0] != [trainer.train_prompts[i % 5] for i in range(7)]  # not the file order
    # (uneven shares over processes: test_distributed.py, 15 samples on 2 processes)


# --- reward whitening (OpenAI 2019) ------------------------------------------------------------


def test_whiten_rewards_scales_the_shaped_rewards_and_keeps_their_mean(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"advantage.whiten_rewards": True}))
    ro = trainer.rollout(trainer.next_prompts())
    rewards, advantages, returns = trainer.advantages(ro)
    raw = shape_rewards(ro.scores, ro.old_logprobs, ro.ref_logprobs, ro.mask, trainer.kl_ctl.value)
    assert torch.allclose(rewards, raw)  # what is returned (and logged) is before the scaling
    real = ro.mask.bool()
    x = raw[real].double()
    white = torch.zeros_like(raw)
    white[real] = ((x - x.mean()) / torch.sqrt(x.var() + 1e-8) + x.mean()).float()  # whiten(rewards, shift_mean=False)
    from ppo_lab.gae import compute_gae

    want_adv, want_ret = compute_gae(white, ro.values, ro.mask, gamma=1.0, lam=0.95)
    assert torch.allclose(returns, want_ret, atol=1e-5)
    assert torch.allclose(advantages, masked_whiten(want_adv, ro.mask), atol=1e-5)
    _, plain, _ = PPOTrainer(small_config(tmp_path / "b")).advantages(ro)
    assert not torch.allclose(plain, advantages, atol=1e-3)


# --- the optimizer: Adam's epsilon, clipping per model ------------------------------------------


def test_adam_eps_and_weight_decay_reach_the_optimizer(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"optim.adam_eps": 1e-5, "optim.weight_decay": 0.01}))
    assert {(group["eps"], group["weight_decay"]) for group in trainer.optimizer.param_groups} == {(1e-5, 0.01)}


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_per_model_clipping_leaves_the_policy_gradient_alone(tiny_path, tmp_path, critic):
    """A critic gradient norm 1000x the policy's: one global norm shrinks the policy's gradient
    about 500-fold with it; per-model clipping leaves it as it was (below the limit) and clips
    the critic's alone."""
    norms = {}
    for scope in ("global", "per-model"):
        trainer = PPOTrainer(small_config(tmp_path / scope, {"critic.design": critic, "optim.max_grad_norm": 1.0, "optim.clip_scope": scope}))
        policy_params, critic_params = (g["params"] for g in trainer.optimizer.param_groups)
        g = torch.Generator().manual_seed(0)
        for p in policy_params:
            p.grad = torch.randn(p.shape, generator=g)
        for p in critic_params:
            p.grad = torch.randn(p.shape, generator=g)
        scale = lambda ps: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ps]))  # noqa: E731
        k_policy, k_critic = 0.5 / scale(policy_params), 500.0 / scale(critic_params)
        for p in policy_params:
            p.grad *= k_policy
        for p in critic_params:
            p.grad *= k_critic
        before = [p.grad.clone() for p in policy_params]
        metrics = trainer.stepper.clip_gradients()
        norms[scope] = (metrics, scale(policy_params).item(), scale(critic_params).item())
        if scope == "per-model":
            assert all(torch.equal(p.grad, b) for p, b in zip(policy_params, before))
    (m_global, pol_global, crit_global), (m_per, pol_per, crit_per) = norms["global"], norms["per-model"]
    assert set(m_global) == {"policy/grad_norm"} and m_global["policy/grad_norm"].item() == pytest.approx(math.hypot(0.5, 500.0), rel=1e-4)
    assert pol_global == pytest.approx(0.5 / math.hypot(0.5, 500.0), rel=1e-3)  # the policy's gradient shrank ~500x
    assert crit_global == pytest.approx(500.0 / math.hypot(0.5, 500.0), rel=1e-3)
    assert m_per["policy/grad_norm"].item() == pytest.approx(0.5, rel=1e-4) and m_per["critic/grad_norm"].item() == pytest.approx(500.0, rel=1e-4)
    assert pol_per == pytest.approx(0.5, rel=1e-4) and crit_per == pytest.approx(1.0, rel=1e-3)


def test_linear_schedule_reaches_zero_after_the_last_step(tiny_path, tmp_path):
    history = PPOTrainer(small_config(tmp_path, {"optim.schedule": "linear", "optim.lr": 1e-3, "optim.early_stop_kl": None})).train()
    assert [m["lr"] for m in history] == [pytest.approx(5e-4), 0.0]  # 4 of 8 steps, then all 8


def test_per_model_clipping_logs_both_norms(tiny_path, tmp_path):
    (m,) = PPOTrainer(small_config(tmp_path, {"optim.clip_scope": "per-model", "run.iterations": 1})).train()
    assert math.isfinite(m["policy/grad_norm"]) and math.isfinite(m["critic/grad_norm"])


# --- the reward model is read at the EOS token it was trained on -------------------------------


@pytest.fixture(scope="module")
def eos_reward_model(tmp_path_factory):
    """A tiny reward model trained (at the EOS, as train_reward_model does) on VADER pairs."""
    from ppo_lab.reward_model import preference_pairs, train_reward_model
    from ppo_lab.tasks import SentimentTask

    folder = tmp_path_factory.mktemp("rm") / "rm"
    train_reward_model(preference_pairs(SentimentTask(), 300, seed=1), folder, epochs=3)
    return folder


def _read_at(model, ids, att, position):
    """The head's output at `position` of each right-padded row (a slow reference)."""
    hidden = model.transformer(input_ids=ids, attention_mask=att)[0]
    return model.score(hidden[torch.arange(len(ids)), position])[:, -1].float()


def test_under_bf16_autocast_the_scores_are_not_rounded_to_bf16(eos_reward_model):
    """The backbone runs in bf16, the score head in float32: a bf16 head would round the scores
    to a grid (steps of 2^-5 between 4 and 8), and a group of near-equal scores would tie."""
    rm = SequenceClassifierReward(str(eos_reward_model))
    ids, att = encode_pairs(rm.tokenizer, ["the movie was"] * 6, ["good .", "bad .", "great fun .", "dull .", "ok .", "a mess ."], ended=[True] * 6)
    exact = sequence_scores(rm.model, ids, att)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = sequence_scores(rm.model, ids, att)
    assert mixed.dtype == torch.float32
    assert (mixed.to(torch.bfloat16).float() != mixed).any()  # off the bf16 grid
    assert torch.allclose(mixed, exact, rtol=0.05, atol=0.05)  # and near the float32 scores


def test_sequence_scores_reads_the_last_real_token_whatever_the_padding(eos_reward_model):
    rm = SequenceClassifierReward(str(eos_reward_model))
    tok, model = rm.tokenizer, rm.model
    ids, att = encode_pairs(tok, ["the movie was", "it is"], ["good .", "a very bad day ."], ended=[True, True])
    last = att.sum(1) - 1
    want = _read_at(model, ids, att, last)
    assert torch.allclose(sequence_scores(model, ids, att), want, atol=1e-5)
    assert (ids[torch.arange(2), last] == tok.eos_token_id).all()
    # the same rows left-padded, and padded with the EOS id itself (pad == eos)
    left_ids, left_att = torch.zeros_like(ids), torch.zeros_like(att)
    for i in range(2):
        n = int(att[i].sum())
        left_ids[i, -n:], left_att[i, -n:] = ids[i, :n], 1
    assert torch.allclose(sequence_scores(model, left_ids, left_att), want, atol=1e-5)
    eos_padded = torch.where(att.bool(), ids, torch.full_like(ids, tok.eos_token_id))
    assert torch.allclose(sequence_scores(model, eos_padded, att), want, atol=1e-5)
    # transformers' own pooling finds the last non-pad token: with pad == eos it reads one early
    model.config.pad_token_id = tok.eos_token_id
    hf = model(input_ids=eos_padded, attention_mask=att).logits[:, -1]
    assert torch.allclose(hf, _read_at(model, ids, att, last - 1), atol=1e-5)
    assert not torch.allclose(hf, want, atol=1e-3)


def test_the_trainer_scores_at_the_sampled_eos(eos_reward_model, tmp_path):
    """The rollout's scores are the reward model read at each response's last real token (its
    EOS when it ended), from the ids as sampled; reading the decoded and re-tokenised text,
    as the trainer once did, lands on the word before the EOS and gives other scores."""
    trainer = PPOTrainer(small_config(tmp_path, {"reward.source": str(eos_reward_model), "batch.rollout": 32}))
    assert trainer.reward_by_ids
    ro = trainer.rollout(trainer.next_prompts())
    assert bool(ro.ended.any())
    model = trainer.reward_fn.model
    ids = torch.cat([ro.query_ids, ro.response_ids], 1)
    att = torch.cat([ro.query_mask, ro.mask.long()], 1)
    order = torch.sort(1 - att, dim=1, stable=True).indices
    ids, att = ids.gather(1, order), att.gather(1, order)
    last = att.sum(1) - 1
    assert torch.equal(ids[ro.ended, last[ro.ended]], torch.full_like(last[ro.ended], trainer.tokenizer.eos_token_id))
    assert torch.allclose(ro.scores, _read_at(model, ids, att, last), atol=1e-5)
    # the old path: the decoded text, re-tokenised, read at its last token (the word before EOS)
    old = SequenceClassifierReward(str(eos_reward_model))(ro.prompts, ro.responses)
    assert not torch.allclose(ro.scores[ro.ended], old[ro.ended], atol=1e-2)
    # with another tokenizer the text goes through, with that tokenizer's EOS appended: same scores
    trainer.reward_by_ids = False
    by_text = trainer.score(ro.prompts, ro.responses, _sample_of(ro))
    assert torch.allclose(by_text, ro.scores.cpu(), atol=1e-5)


def _sample_of(ro):
    from ppo_lab.sampling import Sample

    return Sample(ro.query_ids, ro.query_mask, ro.response_ids, ro.mask, ro.ended)


def test_a_python_reward_can_ask_whether_each_response_ended(tiny_path, tmp_path):
    seen = []

    def reward(prompts, responses, ended):
        seen.append(list(ended))
        return [1.0 if e else -1.0 for e in ended]

    trainer = PPOTrainer(small_config(tmp_path, {"sampling.max_new_tokens": 4, "batch.rollout": 32}), reward_fn=reward)
    ro = trainer.rollout(trainer.next_prompts())
    assert seen[-1] == ro.ended.tolist() and {True, False} <= set(seen[-1])  # both kinds occurred
    eos = trainer.tokenizer.eos_token_id
    last = ro.response_ids.gather(1, (ro.mask.sum(1).long() - 1)[:, None]).squeeze(1)
    assert seen[-1] == (last == eos).tolist()  # ended = the last real token is the EOS
    assert ro.scores.tolist() == [1.0 if e else -1.0 for e in ro.ended.tolist()]


# --- the reward-model trainer --------------------------------------------------------------------


def test_train_reward_model_follows_the_recipe(tmp_path, monkeypatch):
    """The recipe's steps are wired in: a new head from init_reward_head, one epoch by default,
    the learning rate falling linearly over exactly the steps taken."""
    from ppo_lab import reward_model
    from ppo_lab.tasks import SentimentTask

    heads, factors = [], []
    init, linear = reward_model.init_reward_head, reward_model.linear_to_zero
    monkeypatch.setattr(reward_model, "init_reward_head", lambda head: heads.append(head.in_features) or init(head))

    def spy(total):
        f = linear(total)
        return lambda step: factors.append((total, step)) or f(step)

    monkeypatch.setattr(reward_model, "linear_to_zero", spy)
    pairs = reward_model.preference_pairs(SentimentTask(), 70, seed=0)
    reward_model.train_reward_model(pairs, tmp_path / "rm", batch_size=32)
    assert heads == [96]  # the tiny model's hidden size
    assert [step for _, step in factors] == [0, 1, 2, 3] and {t for t, _ in factors} == {3}  # ceil(70 / 32) = 3 steps, one epoch
    with pytest.raises(ValueError, match="needs a decoder base"):
        monkeypatch.setattr("ppo_lab.rewards.reads_at_a_token", lambda model: False)
        reward_model.train_reward_model(pairs, tmp_path / "x")


def test_reward_head_init_and_linear_annealing():
    from ppo_lab.reward_model import init_reward_head, linear_to_zero

    head = init_reward_head(torch.nn.Linear(4095, 1, bias=True))
    assert float(head.weight.detach().std()) == pytest.approx(1 / math.sqrt(4096), rel=0.05)
    assert float(head.bias.detach().abs().max()) == 0.0
    f = linear_to_zero(4)
    assert [f(s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="total_steps = 0"):
        linear_to_zero(0)


def test_reward_model_normalised_after_training(tmp_path):
    from ppo_lab.reward_model import preference_pairs, train_reward_model
    from ppo_lab.tasks import SentimentTask

    pairs = preference_pairs(SentimentTask(), 200, seed=2)
    prompts, responses = [p.prompt for p in pairs[:64]], [p.chosen for p in pairs[:64]]
    out = train_reward_model(pairs[64:], tmp_path / "rm", epochs=2, normalize_on=(prompts, responses))
    rm = SequenceClassifierReward(str(tmp_path / "rm"))
    assert (rm.gain, rm.bias) == (pytest.approx(out["reward_model/gain"]), pytest.approx(out["reward_model/bias"]))
    s = rm(prompts, responses, ended=[True] * 64)
    assert float(s.mean()) == pytest.approx(0.0, abs=1e-4) and float(s.std()) == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(ValueError, match="epochs = 0"):
        train_reward_model(pairs, tmp_path / "x", epochs=0)


# --- prompts from a file, models at a revision ----------------------------------------------------


def test_prompts_from_json_lines_with_a_bom_and_crlf(tmp_path):
    from ppo_lab.build import read_prompts

    # a BOM, CRLF line ends and a raw U+2028 (a line separator to str.splitlines) inside a string
    (tmp_path / "p.JSON").write_bytes('\ufeff{"prompt": "a\u2028b"}\r\n{"prompt": "c"}\r\n'.encode("utf-8"))
    assert read_prompts(str(tmp_path / "p.JSON")) == ["a\u2028b", "c"]


def test_prompts_from_files(tiny_path, tmp_path):
    from ppo_lab.build import read_prompts

    (tmp_path / "p.txt").write_text("the movie was\n\nthis food is\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"query": "the story is", "id": 1}) + "\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["the movie was", "this food is"]
    assert read_prompts(str(tmp_path / "p.jsonl"), "query") == ["the story is"]
    with pytest.raises(ValueError, match=r"line 1: no 'prompt' \(has 'query', 'id'\); set data.prompt_field"):
        read_prompts(str(tmp_path / "p.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        read_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match=r"prompts file '/no/such.txt' does not exist"):
        read_prompts("/no/such.txt")
    with pytest.raises(ValueError, match=r"p.jsonl', line 1: no 'prompt' \(has"):
        PPOTrainer(small_config(tmp_path, {
                "data.prompts_file": str(tmp_path / "p.txt"),
                "data.eval_prompts_file": str(tmp_path / "p.jsonl"),
            }))
    # the .txt file is read line by line; prompt_field only matters for the .jsonl one
    files = {
        "data.prompts_file": str(tmp_path / "p.txt"), "data.eval_prompts_file": str(tmp_path / "p.jsonl"),
        "data.prompt_field": "query",
    }
    trainer = PPOTrainer(small_config(tmp_path, files, {"run.iterations": 1, "run.eval_interval": 1, "run.save_interval": 1}))
    assert (trainer.train_prompts, trainer.eval_prompts) == (["the movie was", "this food is"], ["the story is"])
    assert set(trainer.next_prompts()) <= {"the movie was", "this food is"}
    trainer.train()
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert {s["prompt"] for s in samples} == {"the story is"}
    assert PPOTrainer(small_config(tmp_path, files, {"run.iterations": 1, "run.resume_from": "latest"})).iteration == 1
    with pytest.raises(ValueError, match="training prompts were passed in and data.prompts_file"):
        PPOTrainer(small_config(tmp_path / "c", files), train_prompts=["x"])


def test_model_names_may_carry_a_revision(monkeypatch):
    from ppo_lab import models

    assert models.split_revision("org/model@branch_1") == ("org/model", "branch_1")
    assert models.split_revision("org/model") == ("org/model", None)
    assert models.split_revision("./local@folder") == ("./local@folder", None)
    assert models.split_revision(Path("/models/a@b")) == ("/models/a@b", None)  # a pathlib.Path is a local folder
    with pytest.raises(ValueError, match="both parts non-empty"):
        models.split_revision("org/model@")
    calls = []

    class Loader:
        __name__ = "AutoTokenizer"

        @staticmethod
        def from_pretrained(path, **kwargs):
            calls.append((path, kwargs))
            return "ok"

    Loader.__name__ = "AutoTokenizer"
    assert models.load_pretrained(Loader, "org/model@sft__44413", "tokenizer") == "ok"
    assert calls == [("org/model", {"revision": "sft__44413"})]


# --- the offline recipe preset ---------------------------------------------------------------------


def test_the_offline_recipe_preset_trains_end_to_end(tiny_path, tmp_path):
    """tiny-rlhf-recipe (every detail above at once) trains with evaluation and checkpoints,
    and resumes without refitting the score normalisation."""
    from ppo_lab import PPOConfig

    cfg = PPOConfig.from_yaml("tiny-rlhf-recipe", **{
            "run.output_dir": str(tmp_path / "run"), "run.iterations": 3, "run.eval_interval": 1,
            "run.save_interval": 1, "run.progress_bar": False, "reward.reference_samples": 32,
        })
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    assert len(history) == 3 and all(math.isfinite(m["reward/score_mean"]) for m in history)
    assert all(m["policy/steps"] == 4 for m in history)  # one minibatch per epoch, no early stop
    assert (tmp_path / "run" / "policy").is_dir() and (tmp_path / "run" / "samples.jsonl").is_file()
    assert trainer.score_gain != 1.0
    resumed = PPOTrainer(PPOConfig.from_yaml("tiny-rlhf-recipe", **{
            "run.output_dir": str(tmp_path / "run"), "run.iterations": 4, "run.eval_interval": 1,
            "run.save_interval": 1, "run.progress_bar": False, "reward.reference_samples": 32,
            "run.resume_from": "latest",
        }))
    assert (resumed.score_gain, resumed.score_bias) == (trainer.score_gain, trainer.score_bias)
    history = resumed.train()
    assert [m["iteration"] for m in history] == [1, 2, 3, 4]


def test_masked_whiten_keeps_the_mean_when_asked(gen):
    x, m = torch.randn(4, 6, generator=gen), torch.ones(4, 6)
    m[0, 3:] = 0
    w = masked_whiten(x, m, shift_mean=False)
    assert float(w[m.bool()].mean()) == pytest.approx(float(x[m.bool()].mean()), abs=1e-6)


def test_per_model_clipping_unscales_fp16_gradients_once(tiny_path, tmp_path):
    """Under a loss scaler (fp16 on a GPU, emulated here as test_scale.py does) the gradients are
    unscaled once before both norms: the norms equal those of the same step without a scaler."""
    from test_scale import _emulate_fp16_loss_scaling

    plain = PPOTrainer(small_config(tmp_path / "plain", {"optim.clip_scope": "per-model", "optim.early_stop_kl": None})).iterate()
    trainer = PPOTrainer(small_config(tmp_path / "scaled", {"optim.clip_scope": "per-model", "optim.early_stop_kl": None}))
    _emulate_fp16_loss_scaling(trainer, torch.amp.GradScaler("cpu", init_scale=2.0**8))
    scaled = trainer.iterate()
    assert scaled["train/overflow_steps"] == 0.0 and scaled["policy/steps"] == plain["policy/steps"]
    for key in ("policy/grad_norm", "critic/grad_norm"):
        assert scaled[key] == pytest.approx(plain[key], rel=1e-4), key


# --- defaults the recipes share, each tested where it is made -----------------------------------


def test_vf_coef_weighs_the_value_loss(tiny_path, tmp_path):
    import dataclasses

    trainer = PPOTrainer(small_config(tmp_path, {"critic.design": "shared"}))
    ro = trainer.rollout(trainer.next_prompts())
    _, adv, ret = trainer.advantages(ro)
    idx = torch.arange(8)
    losses = {}
    for c in (0.1, 0.5):
        trainer.config = trainer.config.replace({"critic.loss_coef": c})
        trainer.objective = Objective(trainer.config, trainer.choices)  # where the config meets the loss
        loss, metrics = trainer.minibatch_loss(ro, idx, adv, ret)
        losses[c] = (loss.item(), metrics["loss/policy"].item(), metrics["loss/value"].item())
    (l1, p1, v1), (l5, p5, v5) = losses[0.1], losses[0.5]
    assert (p1, v1) == pytest.approx((p5, v5))
    assert l5 - l1 == pytest.approx(0.4 * v1, rel=1e-4) and v1 > 0


def test_one_temperature_everywhere_keeps_the_first_step_on_policy(tiny_path, tmp_path):
    """At temperature 0.7 (the recipes'), the sampling logits, the policy's scoring forward and
    the reference's all divide by the same 0.7: the reference agrees with the sampler exactly
    before the first update, and the first minibatch's ratio is 1."""
    for source in ("sampling", "forward"):
        trainer = PPOTrainer(small_config(tmp_path / source, {"sampling.temperature": 0.7, "sampler.old_logprobs_from": source}))
        ro = trainer.rollout(trainer.next_prompts())
        real = ro.mask.bool()
        assert torch.allclose(ro.old_logprobs[real], ro.ref_logprobs[real], atol=1e-5)
        _, adv, ret = trainer.advantages(ro)
        _, metrics = trainer.minibatch_loss(ro, torch.arange(8), adv, ret)
        assert abs(metrics["policy/ratio_max"].item() - 1.0) < 1e-5 and metrics["policy/approx_kl"].item() < 1e-9


def test_the_shared_value_head_starts_at_zero(tiny_path, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"critic.design": "shared"}))
    head = trainer.bare(trainer.policy).v_head
    assert float(head.weight.detach().abs().max()) == 0.0 and float(head.bias.detach().abs().max()) == 0.0
    ro = trainer.rollout(trainer.next_prompts())
    assert float(ro.values.abs().max()) == 0.0


# --- the EOS on the id path when another stop token ended the response, and a BOS in front ------


def test_a_stop_token_ending_gets_the_eos_the_reward_model_was_trained_on(eos_reward_model, tmp_path):
    trainer = PPOTrainer(small_config(tmp_path, {"reward.source": str(eos_reward_model), "sampling.stop_token": ".", "batch.rollout": 32}))
    ro = trainer.rollout(trainer.next_prompts())
    period = trainer.tokenizer.convert_tokens_to_ids(".")
    last = ro.response_ids.gather(1, (ro.mask.sum(1).long() - 1)[:, None]).squeeze(1)
    assert bool((ro.ended & (last == period)).any())  # responses that ended on the period exist
    rm = trainer.reward_fn
    by_text = rm(ro.prompts, ro.responses, ended=ro.ended.tolist())  # EOS appended to every ended response
    assert torch.allclose(ro.scores.cpu(), by_text, atol=1e-5)
    as_sampled = rm.score_ids(ro.query_ids, ro.query_mask, ro.response_ids, ro.mask)  # read at the period
    assert not torch.allclose(as_sampled[last == period], by_text[last == period], atol=1e-3)


def test_the_id_path_puts_the_tokenizers_bos_in_front(eos_reward_model, tiny_path):
    from tokenizers.processors import TemplateProcessing

    from ppo_lab.models import load_policy, load_tokenizer
    from ppo_lab.rewards import special_prefix

    rm = SequenceClassifierReward(str(eos_reward_model))
    assert special_prefix(rm.tokenizer) == [] and rm.prefix == []
    bos = rm.tokenizer.unk_token_id  # the tiny vocabulary has no BOS: <unk> stands in for one
    rm.tokenizer._tokenizer.post_processor = TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", bos)])
    assert special_prefix(rm.tokenizer) == [bos]
    rm.prefix = special_prefix(rm.tokenizer)
    tok, lm = load_tokenizer("builtin:tiny"), load_policy("builtin:tiny")
    prompts = ["the movie was", "this food is", "the story is", "it was"]
    drawn = generate(lm, tok, prompts, Sampling(max_new_tokens=8, stop_ids=(tok.eos_token_id,)), uniforms=torch.rand(4, 8, generator=torch.Generator().manual_seed(0)))
    responses = tok.batch_decode(drawn.response_ids, skip_special_tokens=True)
    by_text = rm(prompts, responses, ended=drawn.ended.tolist())  # the tokenizer adds the BOS here
    by_ids = rm.score_ids(drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask, drawn.ended)
    assert torch.allclose(by_ids, by_text, atol=1e-5)
    rm.prefix = []
    assert not torch.allclose(rm.score_ids(drawn.query_ids, drawn.query_mask, drawn.response_ids, drawn.mask, drawn.ended), by_text, atol=1e-3)


def test_entropy_coef_subtracts_the_entropy_bonus(tiny_path, tmp_path):
    import dataclasses

    trainer = PPOTrainer(small_config(tmp_path))
    ro = trainer.rollout(trainer.next_prompts())
    _, adv, ret = trainer.advantages(ro)
    plain, _ = trainer.minibatch_loss(ro, torch.arange(8), adv, ret)
    trainer.config = trainer.config.replace({"loss.entropy_coef": 0.01})
    trainer.objective = Objective(trainer.config, trainer.choices)  # where the config meets the loss
    bonus, metrics = trainer.minibatch_loss(ro, torch.arange(8), adv, ret)
    assert metrics["loss/entropy"].item() > 0
    assert bonus.item() - plain.item() == pytest.approx(-0.01 * metrics["loss/entropy"].item(), rel=1e-4)
