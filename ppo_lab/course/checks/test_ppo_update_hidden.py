"""Hidden checks of assignment 'ppo_update'."""

import torch
from _grading import close, expect, graded, lab
from test_ppo_update_public import setting


@graded("ppo_update", 3)
def test_a_step_descends_the_clipped_losses():
    """a step descends the clipped policy loss plus vf_coef times the clipped value loss"""
    model, batch = setting(seed=1)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    adv, ret, _ = lab().ppo_update(model, opt, batch, kl_coef=0.1, epochs=1, vf_coef=0.3)
    # the expected step, from the same weights, with the advantages and returns it returned
    ref = type(model)(model.tokens, 1)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), start):
            p.copy_(w)
    m = batch["mask"]
    lp, v = ref(torch.arange(m.shape[0]))
    ratio = torch.exp(lp - batch["old_logprobs"])
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    v_clip = batch["old_values"] + (v - batch["old_values"]).clamp(-0.2, 0.2)
    value = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    loss = (policy * m).sum() / m.sum() + 0.3 * (value * m).sum() / m.sum()
    loss.backward()
    for name, p, r, w in zip(("logits", "values"), model.parameters(), ref.parameters(), start):
        close(p.detach(), w - 0.5 * r.grad, f"the {name} after one SGD step (lr 0.5) on the whole batch: "
              "the loss is the token-mean clipped policy loss plus vf_coef (0.3) times the token-mean clipped value loss")


@graded("ppo_update", 1)
def test_good_responses_become_more_likely():
    """the response with the highest score becomes more likely, the one with the lowest less likely"""
    model, batch = setting(lengths=(5, 5, 5, 5), seed=2, scores=[1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        before, _ = model(torch.arange(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lab().ppo_update(model, opt, batch, kl_coef=0.0, epochs=2)
    with torch.no_grad():
        after, _ = model(torch.arange(4))
    change = (after - before).sum(-1)
    expect(float(change[0]) > 0 and float(change[1]) < 0,
           f"after the update the log-probability of the best response (score +1) changed by {float(change[0]):+.4f} "
           f"and of the worst (score -1) by {float(change[1]):+.4f}: the update should raise the first and lower the second")


@graded("ppo_update", 1)
def test_padding_changes_nothing():
    """what the batch holds at padded positions changes nothing"""
    a_model, batch = setting(seed=3)
    b_model, _ = setting(seed=3)
    m = batch["mask"]
    junk = dict(batch)
    for key, value in (("old_logprobs", 40.0), ("ref_logprobs", -40.0), ("old_values", 25.0)):
        junk[key] = torch.where(m > 0, batch[key], torch.full_like(batch[key], value))
    adv_a, _, _ = lab().ppo_update(a_model, torch.optim.SGD(a_model.parameters(), lr=0.2), batch, kl_coef=0.1, epochs=1)
    adv_b, _, _ = lab().ppo_update(b_model, torch.optim.SGD(b_model.parameters(), lr=0.2), junk, kl_coef=0.1, epochs=1)
    close(adv_b, adv_a, "advantages with junk stored at padded positions")
    for name, p, q in zip(("logits", "values"), a_model.parameters(), b_model.parameters()):
        close(q.detach(), p.detach(), f"the {name} after an update with junk stored at padded positions")


@graded("ppo_update", 1)
def test_each_step_uses_its_own_minibatch_alone():
    """each step's gradient comes from its own minibatch alone (the gradients are zeroed between steps)"""
    model, batch = setting(seed=4)
    calls, stepped = [], []

    def forward(rows):
        calls.append(sorted(rows.tolist()))
        return model(rows)

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in (model.logits, model.values)]
            rows = (grads[0].abs().sum((1, 2)) > 0) | (grads[1].abs().sum(1) > 0)
            stepped.append(torch.nonzero(rows).flatten().tolist())
            return super().step(closure)

    lab().ppo_update(forward, Recording(model.parameters(), lr=0.1), batch, kl_coef=0.1, epochs=2, minibatch_size=3)
    expect(len(stepped) == len(calls) == 4, f"6 rows, minibatches of 3, 2 epochs: expected 4 forwards and 4 steps, saw {len(calls)} and {len(stepped)}")
    for k, (rows, with_grad) in enumerate(zip(calls, stepped)):
        expect(set(with_grad) <= set(rows),
               f"step {k} had gradient on rows {with_grad} but its minibatch was rows {rows}: the gradient of an earlier "
               "minibatch was still there (zero the gradients before each backward)")
