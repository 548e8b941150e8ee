#!/usr/bin/env python3
"""Side-by-side timings of ppo_lab's hot spots and a cheaper way to do the same work.

Each pair runs at the shapes of the benchmark's workload (32 responses x 32 tokens, minibatches
of 8, vocabulary 1024, temperature 0.7, the GPT-2 of workload.py), interleaved A, B, A, B, ...
so that the machine's drifts hit both alike; medians are reported in milliseconds per PPO update
(a per-call time times the calls one update makes). Needs ppo_lab importable (PYTHONPATH).

    PYTHONPATH=/path/to/checkout python benchmarks/hotspots.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import workload as wl  # sets the offline environment before transformers is imported

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--reps", type=int, default=15)
    return p.parse_args(argv)


def race(variants: dict, reps: int, per_update: int) -> dict:
    """Interleaved timings of each callable; {name: median ms per update}."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: round(statistics.median(v) * 1000 * per_update, 1) for k, v in times.items()}


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    from ppo_lab.clipping import clipped_policy_loss
    from ppo_lab.logprobs import entropy_from_logits, logprobs_from_logits
    from ppo_lab.value import clipped_value_loss

    tau, B, T, V = args.temperature, args.batch, args.response_length, args.vocab
    mb = B // args.mini_batches
    steps = args.ppo_epochs * args.mini_batches
    g = torch.Generator().manual_seed(0)
    out = {}

    # 1. log-probs of the sampled tokens at temperature tau, forward + backward, one minibatch
    logits_mb = torch.randn(mb, T, V, generator=g)
    tokens_mb = torch.randint(0, V, (mb, T), generator=g)

    def lp_rows():
        x = logits_mb.clone().requires_grad_(True)
        logprobs_from_logits(x, tokens_mb, tau).sum().backward()

    def lp_vectorised():
        x = logits_mb.clone().requires_grad_(True)
        z = x / tau
        (z.gather(-1, tokens_mb[..., None]).squeeze(-1) - torch.logsumexp(z, -1)).sum().backward()

    out["update: logprobs_from_logits fwd+bwd (per-row loop vs one batched gather - logsumexp)"] = race(
        {"ppo_lab": lp_rows, "batched": lp_vectorised}, args.reps, steps)

    # 2. rollout: log-probs (policy + reference) and entropy over the whole batch, no grad
    logits_b = torch.randn(B, T, V, generator=g)
    tokens_b = torch.randint(0, V, (B, T), generator=g)

    @torch.no_grad()
    def score_rows():
        logprobs_from_logits(logits_b, tokens_b, tau)
        logprobs_from_logits(logits_b, tokens_b, tau)
        entropy_from_logits(logits_b, tau)

    @torch.no_grad()
    def score_batched():
        for _ in range(2):
            z = logits_b / tau
            z.gather(-1, tokens_b[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
        z = logits_b / tau
        p = torch.softmax(z, -1)
        torch.logsumexp(z, -1) - (p * z).sum(-1)

    out["rollout: 2 x logprobs + entropy (per-row loops vs batched)"] = race(
        {"ppo_lab": score_rows, "batched": score_batched}, args.reps, 1)

    # 3. the loss functions with their checks and metrics, forward + backward, one minibatch
    lp = torch.randn(mb, T, generator=g) * 0.01 - 7
    old_lp, adv = lp + torch.randn(mb, T, generator=g) * 0.01, torch.randn(mb, T, generator=g)
    vals, old_v, ret = (torch.randn(mb, T, generator=g) * 0.1 for _ in range(3))
    mask = torch.ones(mb, T)

    def losses_ppo_lab():
        a, v = lp.clone().requires_grad_(True), vals.clone().requires_grad_(True)
        pl, pm = clipped_policy_loss(a, old_lp, adv, mask, 0.2, None, None, "token-mean")
        vl, vm = clipped_value_loss(v, old_v, ret, mask, 0.2, "token-mean")
        (pl + 0.5 * vl).backward()

    def losses_bare():
        a, v = lp.clone().requires_grad_(True), vals.clone().requires_grad_(True)
        ratio = (a - old_lp).exp()
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        vc = old_v + (v - old_v).clamp(-0.2, 0.2)
        vf = 0.5 * torch.max((v - ret).square(), (vc - ret).square()).mean()
        (pg + 0.5 * vf).backward()

    out["update: clipped policy + value loss fwd+bwd (with checks and metrics vs bare)"] = race(
        {"ppo_lab": losses_ppo_lab, "bare": losses_bare}, args.reps * 4, steps)

    # 4. the optimizer step and gradient clipping over policy + value parameters
    tok, _ = wl.make_tokenizer(args.vocab, args.seed)
    params = [*wl.make_policy(tok, args).parameters(), *wl.make_value_model(tok, args).parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt_default = torch.optim.AdamW(params, lr=args.lr)
    opt_fused = torch.optim.AdamW(params, lr=args.lr, fused=True)
    out["update: AdamW step over policy + value (default vs fused=True)"] = race(
        {"default": opt_default.step, "fused": opt_fused.step}, args.reps, steps)
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    out["update: gradient clipping (accelerate clip_grad_norm_ vs torch foreach)"] = race(
        {"accelerate": lambda: acc.clip_grad_norm_(params, 1.0),
         "torch foreach": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)}, args.reps, steps)

    # 5. GPT-2's gelu_new (6 element-wise ops in Python) vs the fused tanh GELU, policy fwd+bwd
    seq = torch.randint(4, args.vocab, (mb, args.prompt_max + T), generator=g)
    pol_new = wl.no_dropout(wl.make_policy(tok, args)).train()
    pol_fused = wl.no_dropout(wl.make_policy(tok, args)).train()
    pol_fused.config.activation_function = "gelu_pytorch_tanh"
    from transformers.activations import ACT2FN

    for block in pol_fused.transformer.h:
        block.mlp.act = ACT2FN["gelu_pytorch_tanh"]

    def fb(model):
        model(input_ids=seq).logits.sum().backward()
        model.zero_grad(set_to_none=True)

    with torch.no_grad():
        diff = (pol_new(input_ids=seq).logits - pol_fused(input_ids=seq).logits).abs().max().item()
    r = race({"gelu_new": lambda: fb(pol_new), "gelu_pytorch_tanh": lambda: fb(pol_fused)}, args.reps, steps)
    r["max |logit difference|"] = diff
    out["update: policy forward + backward, activation (x16 minibatches)"] = r

    # 6. the rollout's extra policy forward (ppo_lab scores the sampled tokens in a second pass)
    pol = wl.no_dropout(wl.make_policy(tok, args)).eval()
    full = torch.randint(4, args.vocab, (B, args.prompt_max + T), generator=g)

    @torch.no_grad()
    def policy_forward():
        pol(input_ids=full, attention_mask=torch.ones_like(full))

    out["rollout: one policy forward over prompt + response (what reusing the sampling loop's logits saves)"] = race(
        {"forward": policy_forward}, args.reps, 1)

    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
