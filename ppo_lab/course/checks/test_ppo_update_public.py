"""Public checks of assignment 'ppo_update': one PPO update composed from its pieces (chapters 4-7)."""

import torch
from _grading import close, expect, graded, lab, right_padded, slow_gae, slow_whiten


class Table(torch.nn.Module):
    """The smallest model with a policy and a critic: free logits and a free value for every
    (row, position) of the batch, so that every gradient can be checked by hand."""

    def __init__(self, tokens, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        B, T = tokens.shape
        self.tokens = tokens
        self.logits = torch.nn.Parameter(torch.randn(B, T, 5, generator=g) * 0.5)
        self.values = torch.nn.Parameter(torch.randn(B, T, generator=g) * 0.3)

    def forward(self, rows):
        lp = torch.log_softmax(self.logits[rows], -1).gather(-1, self.tokens[rows, :, None]).squeeze(-1)
        return lp, self.values[rows]


def setting(lengths=(6, 4, 6, 2, 5, 6), seed=0, scores=None):
    """A model and the batch it sampled (on-policy: old log-probs and values are the model's own)."""
    g = torch.Generator().manual_seed(seed + 100)
    B, T = len(lengths), max(lengths)
    model = Table(torch.randint(0, 5, (B, T), generator=g), seed)
    with torch.no_grad():
        lp, v = model(torch.arange(B))
    batch = {"scores": torch.randn(B, generator=g) if scores is None else torch.tensor(scores, dtype=torch.float32),
             "old_logprobs": lp.clone(), "ref_logprobs": lp + 0.1 * torch.randn(B, T, generator=g),
             "old_values": v.clone(), "mask": right_padded(list(lengths), T)}
    return model, batch


def slow_advantages(batch, kl_coef, gamma, lam):
    m = batch["mask"]
    rewards = -kl_coef * (batch["old_logprobs"] - batch["ref_logprobs"]).double() * m
    last = (m * torch.arange(m.shape[1])).argmax(-1)
    rewards[torch.arange(m.shape[0]), last] += batch["scores"].double()
    adv, ret = slow_gae(rewards, batch["old_values"], m, gamma, lam)
    return slow_whiten(adv, m), ret


@graded("ppo_update", 3)
def test_advantages_are_whitened_gae_of_the_shaped_rewards():
    """the advantages are the whitened GAE advantages of the shaped rewards; the returns are the lambda-returns"""
    model, batch = setting()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv, ret, _ = lab().ppo_update(model, opt, batch, kl_coef=0.2, gamma=1.0, lam=0.9, epochs=1)
    want_adv, want_ret = slow_advantages(batch, 0.2, 1.0, 0.9)
    close(ret, want_ret, "returns: GAE's lambda-returns of the shaped rewards (score on the last real token, -kl_coef * KL on every one), before whitening")
    close(adv, want_adv, "advantages: GAE of the shaped rewards, then whitened over the real tokens")


class CountingSGD(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


@graded("ppo_update", 2)
def test_one_step_per_minibatch_every_row_once_per_epoch():
    """each epoch visits every row once, in minibatches of minibatch_size, one forward and one optimizer step each (counted in policy/steps)"""
    model, batch = setting()
    seen = []

    def forward(rows):
        seen.append(rows.tolist())
        return model(rows)

    opt = CountingSGD(model.parameters(), lr=0.01)
    _, _, metrics = lab().ppo_update(forward, opt, batch, kl_coef=0.1, epochs=3, minibatch_size=4)
    expect(opt.steps == 6, f"6 rows, minibatches of 4, 3 epochs: expected 6 optimizer steps (2 per epoch), counted {opt.steps}")
    expect([len(r) for r in seen] == [4, 2] * 3, f"expected minibatches of 4 and 2 rows in each epoch, forward saw sizes {[len(r) for r in seen]}")
    for e in range(3):
        rows = sorted(seen[2 * e] + seen[2 * e + 1])
        expect(rows == list(range(6)), f"epoch {e} visited rows {rows}, not each of the 6 rows once")
    expect(metrics.get("policy/steps") == 6, f"metrics['policy/steps'] should count the 6 steps, got {metrics.get('policy/steps')}")
