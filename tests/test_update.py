"""`ppo_update`, the one-screen PPO update (chapter 7 and the course's `ppo_update` assignment):
the same weights as `PPOTrainer.update` under the same settings, and its input checks."""

import copy

import pytest
import torch

from conftest import small_config
from ppo_lab import ppo_update
from ppo_lab.build import draws
from ppo_lab.rollout import critic_values, response_logprobs
from ppo_lab.trainer import PPOTrainer


def _weights(trainer):
    return [p.detach().clone() for p in trainer.trained_parameters()]


@pytest.mark.parametrize("value_clip", [0.2, None])
def test_ppo_update_moves_the_weights_as_the_trainer_does(tmp_path, value_clip):
    """With the trainer's defaults minus gradient clipping and the target-KL early stop (what
    ppo_update leaves out), one update of the same rollout from the same weights, optimizer state
    and shuffles gives the same weights to round-off."""
    cfg = small_config(tmp_path, {
            "optim.max_grad_norm": None, "optim.early_stop_kl": None, "critic.clip": value_clip,
            "batch.epochs": 2, "batch.minibatch": 8,
        })
    trainer = PPOTrainer(cfg)
    ro = trainer.rollout(trainer.next_prompts())
    _, advantages, returns = trainer.advantages(ro)
    start = _weights(trainer)
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.update(ro, advantages, returns)
    by_trainer = _weights(trainer)
    assert any(not torch.equal(a, b) for a, b in zip(start, by_trainer)), "the trainer's update moved nothing"

    with torch.no_grad():
        for p, w in zip(trainer.trained_parameters(), start):
            p.copy_(w)
    trainer.optimizer.load_state_dict(opt_state)
    trainer.set_training(True)

    def forward(rows):
        q, qm, r, m = ro.query_ids[rows], ro.query_mask[rows], ro.response_ids[rows], ro.mask[rows]
        logprobs, _, _ = response_logprobs(trainer.policy, q, qm, r, m, trainer.score_temperature)
        return logprobs, critic_values(trainer.critic, q, qm, r, m).float()

    batch = {"scores": ro.scores, "old_logprobs": ro.old_logprobs, "ref_logprobs": ro.ref_logprobs, "old_values": ro.values, "mask": ro.mask}
    adv, ret, metrics = ppo_update(
        forward, trainer.optimizer, batch, kl_coef=trainer.kl_ctl.value, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, clip_eps=cfg.loss.clip_eps,
        value_clip=cfg.critic.clip, vf_coef=cfg.critic.loss_coef, epochs=cfg.batch.epochs, minibatch_size=cfg.batch.minibatch,
        generator=draws(cfg.run.seed, trainer.iteration, "shuffle"),
    )
    torch.testing.assert_close(adv, advantages)
    torch.testing.assert_close(ret, returns)
    assert metrics["policy/steps"] == cfg.batch.epochs * cfg.batch.rollout // cfg.batch.minibatch
    for ours, theirs in zip(_weights(trainer), by_trainer):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_ppo_update_names_a_missing_batch_entry():
    with pytest.raises(ValueError, match=r"lacks \['old_values'\]"):
        ppo_update(lambda rows: None, None, {"scores": torch.zeros(2), "old_logprobs": torch.zeros(2, 3), "ref_logprobs": torch.zeros(2, 3), "mask": torch.ones(2, 3)}, kl_coef=0.1)
