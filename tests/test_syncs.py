"""Host-device synchronisations: counted on the CPU (`ppo_lab.syncs`), kept out of the hot loop."""

import pytest
import torch

from conftest import small_config
from ppo_lab.syncs import SyncCounter
from ppo_lab.trainer import PPOTrainer


def test_the_counter_counts_read_backs_and_nothing_else():
    x, m = torch.arange(6.0).reshape(2, 3), torch.tensor([[True, False, True], [False, True, True]])
    with SyncCounter() as syncs:
        y = (x * 2 + 1).sum(dim=1)  # device work only
        torch.where(m, x, 0).max()
        y[0].item(), bool(y.all()), y.tolist(), float(y[1]), torch.nonzero(m), x[m]
    assert syncs.total == 6
    assert syncs.by_op == {"item": 1, "__bool__": 1, "tolist": 1, "__float__": 1, "nonzero": 1, "__getitem__": 1}
    assert syncs.by_origin == {"test_syncs": 6}


def _count(tmp_path, *settings):
    trainer = PPOTrainer(small_config(tmp_path, {"run.iterations": 2}, *settings))
    trainer.iterate()  # first iteration: one-time work
    with SyncCounter() as syncs:
        metrics = trainer.iterate()
    return syncs, metrics, trainer.config


def test_one_iteration_reads_back_once_per_minibatch_and_per_generated_token(tiny_path, tmp_path):
    # Before, every micro-batch's loss checked its mask's values (about 30 read-backs each);
    # now the rollout is checked once and the update reads back once per minibatch.
    syncs, metrics, cfg = _count(tmp_path)
    minibatches = cfg.batch.epochs * cfg.batch.rollout // cfg.batch.minibatch
    assert syncs.by_origin["ppo_lab"] <= minibatches + cfg.sampling.max_new_tokens + 6, syncs.by_origin


def test_micro_batches_add_no_read_backs(tiny_path, tmp_path):
    counts = {}
    for ga in (1, 4):
        syncs, metrics, _ = _count(tmp_path / str(ga), {"batch.accumulation_steps": ga, "optim.early_stop_kl": None})
        counts[ga] = syncs.by_origin["ppo_lab"]
    assert counts[1] == counts[4]


def test_value_checks_still_guard_direct_calls():
    from ppo_lab import clipped_policy_loss

    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="only 0 and 1"):
        clipped_policy_loss(lp, lp, lp, torch.full((2, 3), 0.5), 0.2)
