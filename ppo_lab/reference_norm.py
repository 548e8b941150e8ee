"""The score's scale fixed once, from the reference policy's responses (chapter 8).

OpenAI's 2019 runs normalised their reward model so that the reference policy's responses
score mean 0 and std 1; N+ centres its SFT references at 0. `reward.reference_norm`
does the same before the first update: `reference_scores` samples the responses and scores them
with the run's reward, `shaping.reference_normalization` turns the scores into a gain and a
bias, and `shaping.adjust_scores` applies them to every score of the run. The pair is kept in
checkpoints (`resume.py`), so a resumed run does not refit it.
"""

from __future__ import annotations

import torch

from . import distributed as dist
from .build import draws
from .sampling import generate


@torch.no_grad()
def reference_scores(trainer, n: int) -> torch.Tensor:
    """(n,) scores of the reference policy's responses to n training prompts of `trainer` (a
    `PPOTrainer`) drawn at random (without replacement while the set lasts), with draws of their
    own. Each process samples its share, and the result is the same for any number of processes.
    Sampled from the policy before any update, which is the reference then (the adapter is still
    zero under LoRA)."""
    acc, prompts_all = trainer.accelerator, trainer.train_prompts
    g = draws(trainer.config.run.seed, None, "reference")
    order = torch.cat([torch.randperm(len(prompts_all), generator=g) for _ in range(-(-n // len(prompts_all)))])
    prompts = [prompts_all[i] for i in order[:n].tolist()]
    uniforms = torch.rand(n, trainer.sampling.max_new_tokens, generator=g)
    lo, hi = dist.shard(acc, n)
    world, per = acc.num_processes, -(-n // acc.num_processes)
    # Every process samples and scores `per` rows, its share padded with repeats of a row (dropped
    # after): a sharded reward model's forward is a collective, so every process must run as many.
    # Each response depends on its own draws only, so the padding changes no real row.
    rows = list(range(lo, hi)) + [min(lo, n - 1)] * (per - (hi - lo))
    trainer.set_training(False)
    # sharded, every process gathers the policy (a collective), then samples its rows alone
    with trainer.sharding.gathered(trainer.policy):
        with acc.autocast():
            drawn = generate(trainer.lm, trainer.tokenizer, [prompts[i] for i in rows], trainer.sampling, device=trainer.device, uniforms=uniforms[rows])
        responses = trainer.tokenizer.batch_decode(drawn.response_ids, skip_special_tokens=True)
        scores = trainer.score([prompts[i] for i in rows], responses, drawn).to(trainer.device)[: hi - lo]
    if world == 1:
        return scores.cpu()
    # shares differ by one at most: gather them padded to the same length, then cut the padding
    padded = dist.gather(acc, torch.cat([scores, scores.new_zeros(per - len(scores))])).cpu()
    return torch.cat([padded[r * per : r * per + (r + 1) * n // world - r * n // world] for r in range(world)])
