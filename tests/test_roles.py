"""The four roles loaded from local folders (the hub code path), and bad input around them."""

import math

import pytest
import torch

from conftest import small_config
from ppo_lab.models import load_critic, load_policy, load_tokenizer
from ppo_lab.rewards import check_scores, load_reward
from ppo_lab.trainer import PPOTrainer


def rule_reward(prompts, responses):
    """A rule used through the config as 'tests.test_roles:rule_reward' style callables."""
    return [float(len(r.split())) for r in responses]


def test_policy_from_a_local_folder(tiny_path, tmp_path):
    """Save a model the way the hub stores it and train from the folder by name."""
    policy = load_policy(str(tiny_path))
    tokenizer = load_tokenizer(str(tiny_path))
    folder = tmp_path / "my-model"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = small_config(tmp_path, {"policy.model": str(folder), "run.iterations": 1})
    trainer = PPOTrainer(cfg)
    assert trainer.lm.config.n_embd == policy.config.n_embd
    trainer.train()
    reloaded = load_policy(str(tmp_path / "run" / "policy"))
    assert any(not torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), policy.state_dict().values()))


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"could not load the (tokenizer of policy.model|policy model) from '/nowhere/model': no such folder"):
        PPOTrainer(small_config(tmp_path, {"policy.model": "/nowhere/model"}))
    # a name that is not a path goes to the hub, which is off in the tests
    with pytest.raises(ValueError, match=r"could not load the (tokenizer of policy.model|policy model) from 'nobody/no-model' \(not a local folder; hub downloads are off\)"):
        PPOTrainer(small_config(tmp_path, {"policy.model": "nobody/no-model"}))


def test_tokenizer_without_pad_token_gets_eos(tiny_path, tmp_path):
    tokenizer = load_tokenizer(str(tiny_path))
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 1}), tokenizer=tokenizer)
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    (m,) = trainer.train()
    assert math.isfinite(m["loss/policy"])


def test_pad_equal_eos_keeps_the_eos_in_the_mask(tiny_path, tmp_path):
    tokenizer = load_tokenizer(str(tiny_path))
    tokenizer.pad_token = tokenizer.eos_token
    trainer = PPOTrainer(small_config(tmp_path, {"sampling.max_new_tokens": 12}), tokenizer=tokenizer)
    ro = trainer.rollout(trainer.next_prompts())
    eos = tokenizer.eos_token_id
    assert ro.ended.any()
    for ids, mask, has in zip(ro.response_ids, ro.mask, ro.ended):
        n = int(mask.sum())
        if has:
            first = (ids == eos).nonzero()[0].item()
            assert n == first + 1 and ids[n - 1] == eos  # the EOS itself is a real token
        else:
            assert n == ids.shape[0]
    rewards, _, _ = trainer.advantages(ro)
    last = (ro.mask * torch.arange(ro.mask.shape[1])).argmax(1)
    score_part = rewards[torch.arange(len(ro)), last] + trainer.kl_ctl.value * (ro.old_logprobs - ro.ref_logprobs)[torch.arange(len(ro)), last]
    torch.testing.assert_close(score_part, ro.scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "reward, match",
    [
        (lambda p, r: [0.0] * (len(r) - 1), r"returned scores of shape \(15,\) for 16 responses; expected \(16,\)"),
        (lambda p, r: ["good"] * len(r), r"must return one number per response; got a list holding str values such as 'good'"),
        (lambda p, r: torch.zeros(len(r), 2), r"returned scores of shape \(16, 2\)"),
    ],
)
def test_bad_reward_output_is_a_clear_error(tiny_path, tmp_path, reward, match):
    trainer = PPOTrainer(small_config(tmp_path), reward_fn=reward)
    with pytest.raises(ValueError, match=match):
        trainer.train()


def test_check_scores_accepts_lists_tensors_and_columns():
    assert check_scores([1, 2], 2).tolist() == [1.0, 2.0]
    assert check_scores(torch.tensor([[1.0], [2.0]]), 2).tolist() == [1.0, 2.0]


def test_empty_prompt_set(tiny_path, tmp_path):
    with pytest.raises(ValueError, match="the prompt set is empty"):
        PPOTrainer(small_config(tmp_path), train_prompts=[], reward_fn=rule_reward)


def test_prompt_longer_than_the_context(tiny_path, tmp_path):
    long_prompt = " ".join(["the movie was good ."] * 20)  # 100 tokens; the context is 64
    with pytest.raises(ValueError, match=r"prompt 1 has 100 tokens; with max_new_tokens = 8 that is 108 positions, more than the model's context of 64"):
        PPOTrainer(small_config(tmp_path), train_prompts=["the movie was", long_prompt], reward_fn=rule_reward)


def test_unknown_stop_token(tiny_path, tmp_path):
    with pytest.raises(ValueError, match=r"stop_token = 'zzz' is not a token"):
        PPOTrainer(small_config(tmp_path, {"sampling.stop_token": "zzz"}))


def test_reward_from_module_function(tiny_path, tmp_path):
    fn = load_reward("test_roles:rule_reward")
    assert fn(["a"], ["b c"]) == [2.0]
    with pytest.raises(ValueError, match=r"cannot import 'nope' from module 'test_roles'"):
        load_reward("test_roles:nope")
    with pytest.raises(ValueError, match=r"could not load the reward tokenizer from '/no/such/rm'"):
        load_reward("/no/such/rm")


def test_learned_reward_model_end_to_end(tiny_path, tmp_path):
    """Bradley-Terry on VADER-labelled pairs: the reward model ranks held-out pairs, can score
    PPO's responses with its own tokenizer, and can initialise the critic."""
    from ppo_lab.reward_model import preference_pairs, train_reward_model
    from ppo_lab.rewards import SequenceClassifierReward
    from ppo_lab.tasks import SentimentTask

    pairs = preference_pairs(SentimentTask(), 700, seed=0)
    metrics = train_reward_model(pairs[:500], tmp_path / "rm", epochs=10)
    assert metrics["reward_model/accuracy"] > 0.9
    rm = SequenceClassifierReward(str(tmp_path / "rm"))
    held = pairs[500:]
    ended = [True] * len(held)
    chosen = rm([p.prompt for p in held], [p.chosen for p in held], ended=ended)
    rejected = rm([p.prompt for p in held], [p.rejected for p in held], ended=ended)
    assert (chosen > rejected).float().mean() > 0.85
    # read one token early (no EOS appended), the same model ranks the pairs much worse
    early = rm([p.prompt for p in held], [p.chosen for p in held]) > rm([p.prompt for p in held], [p.rejected for p in held])
    assert early.float().mean() < (chosen > rejected).float().mean() - 0.05
    critic = load_critic(str(tmp_path / "rm"))
    assert torch.equal(critic.head.weight, rm.model.score.weight)  # the head came along
    cfg = small_config(tmp_path, {"reward.source": str(tmp_path / "rm"), "critic.model": str(tmp_path / "rm"), "run.iterations": 1})
    (m,) = PPOTrainer(cfg).train()
    assert math.isfinite(m["reward/score_mean"])


def test_bradley_terry_loss_against_the_formula():
    from ppo_lab.reward_model import bradley_terry_loss

    chosen = torch.tensor([2.0, 0.0, -1.0, 50.0])
    rejected = torch.tensor([1.0, 0.5, -1.0, -50.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    want = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 4
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["reward_model/accuracy"].item() == 0.5
    with pytest.raises(ValueError, match=r"`rejected_scores` has shape \(2,\)"):
        bradley_terry_loss(chosen, torch.zeros(2))


def test_a_too_long_eval_prompt_is_named_as_one(tiny_path, tmp_path):
    long_prompt = " ".join(["the movie was good ."] * 20)
    with pytest.raises(ValueError, match=r"eval prompt 1 has 100 tokens"):
        PPOTrainer(small_config(tmp_path), train_prompts=["the movie was"], eval_prompts=["a", long_prompt], reward_fn=rule_reward)
