#!/usr/bin/env python3
"""The floor: the work of one PPO update on the benchmark's workload, with no trainer around it.

Same models, prompts and shapes as the trainers (see workload.py); each update is

  generate  a KV-cache sampling loop (softmax(logits / T), one inverse-CDF draw per row), 32 new
            tokens for 32 prompts; the sampled tokens' log-probs are read from the loop's own
            logits;
  score     the reference forward (log-probs), the value forward, the reward forward;
  advantage KL-shaped rewards and GAE (gamma 1, lambda 0.95), whitened;
  optimise  4 epochs x 4 minibatches of 8: policy forward, log-softmax / gather, value forward,
            clipped PPO loss + value loss, backward, one AdamW step over policy + value.

No gradient clipping, no metrics, no logging: anything a trainer adds on top is overhead.
AdamW is torch's default implementation for the device (on the CPU: one tensor at a time; the
fused one is faster, see profile_ppo_lab.py's report), as in TRL and in ppo_lab. With
`--critic shared` the value is a linear head on the policy's last hidden state, read during the
generation loop itself (the hidden state that sampled token t is the one that gives V(s_t)) and
in the policy forward of each optimizer step.

For reference it also times `model.generate` (with output_scores, as TRL's rollout calls it) at
the same shape. Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import workload as wl  # sets the offline environment before transformers is imported

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    wl.add_workload_args(p)
    p.add_argument("--critic", choices=["separate", "shared", "both"], default="both",
                   help="which floor to measure; 'both' runs separate then shared in one process")
    p.add_argument("--hf-generate-reps", type=int, default=5, help="timings of model.generate for reference (0 = skip)")
    return p.parse_args(argv)


def full_sequence(q, qm, r):
    ids = torch.cat([q, r], 1)
    attn = torch.cat([qm, torch.ones_like(r)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    return ids, attn, pos


def token_logprobs(logits, tokens, temperature):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class Floor:
    def __init__(self, args, tok, prompt_ids, critic: str):
        from transformers import DynamicCache

        self.DynamicCache = DynamicCache
        self.args, self.tok, self.prompt_ids, self.critic = args, tok, prompt_ids, critic
        self.policy = wl.no_dropout(wl.make_policy(tok, args)).train()
        self.ref = wl.no_dropout(wl.make_policy(tok, args)).eval().requires_grad_(False)
        self.reward = wl.no_dropout(wl.make_reward_model(tok, args)).eval().requires_grad_(False)
        if critic == "separate":
            self.value = wl.no_dropout(wl.make_value_model(tok, args)).train()
            params = [*self.policy.parameters(), *self.value.parameters()]
        else:
            self.v_head = torch.nn.Linear(args.n_embd, 1)
            torch.nn.init.zeros_(self.v_head.weight)
            torch.nn.init.zeros_(self.v_head.bias)
            params = [*self.policy.parameters(), *self.v_head.parameters()]
        self.opt = torch.optim.AdamW(params, lr=args.lr)
        self.order: list[int] = []
        self.rng = random.Random(args.seed)
        torch.manual_seed(args.seed)

    def next_batch(self):
        out = []
        while len(out) < self.args.batch:
            if not self.order:
                self.order = list(range(len(self.prompt_ids)))
                self.rng.shuffle(self.order)
            out.append(self.prompt_ids[self.order.pop()])
        enc = self.tok.pad({"input_ids": out}, return_tensors="pt")  # left padding
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def generate(self, q, qm):
        """Sampling loop with the KV cache; returns tokens, their log-probs, and (shared) values."""
        a = self.args
        shared = self.critic == "shared"
        pos = (qm.cumsum(1) - 1).clamp(min=0)
        out = self.policy(input_ids=q, attention_mask=qm, position_ids=pos, past_key_values=self.DynamicCache(),
                          use_cache=True, output_hidden_states=shared)
        mask, last = qm, pos[:, -1:]
        toks, lps, vals = [], [], []
        uniforms = torch.rand(q.shape[0], a.response_length, 1)
        for t in range(a.response_length):
            logp = torch.log_softmax(out.logits[:, -1, :] / a.temperature, -1)
            # inverse-CDF draw: the same distribution as torch.multinomial, several times cheaper
            cdf = logp.exp().cumsum(-1)
            nxt = torch.searchsorted(cdf, uniforms[:, t] * cdf[:, -1:]).clamp(max=cdf.shape[-1] - 1)
            toks.append(nxt)
            lps.append(logp.gather(-1, nxt))
            if shared:
                vals.append(self.v_head(out.hidden_states[-1][:, -1, :]))
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            last = last + 1
            out = self.policy(input_ids=nxt, attention_mask=mask, position_ids=last, past_key_values=out.past_key_values,
                              use_cache=True, output_hidden_states=shared)
        values = torch.cat(vals, 1) if shared else None
        return torch.cat(toks, 1), torch.cat(lps, 1), values

    @torch.no_grad()
    def score(self, q, qm, r):
        a, P = self.args, q.shape[1]
        ids, attn, pos = full_sequence(q, qm, r)
        ref_lp = token_logprobs(self.ref(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1:-1], r,
                                a.temperature)
        values = None
        if self.critic == "separate":
            h = self.value.transformer(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
            values = self.value.score(h[:, P - 1:-1]).squeeze(-1)
        h = self.reward.transformer(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        scores = self.reward.score(h[:, -1]).squeeze(-1)  # fixed-length responses: the last token is real
        return ref_lp, values, scores

    @torch.no_grad()
    def advantages(self, lp, ref_lp, values, scores, gamma=1.0, lam=0.95):
        rewards = -self.args.kl_coef * (lp - ref_lp)
        rewards[:, -1] += scores
        T = rewards.shape[1]
        adv = torch.zeros_like(rewards)
        last = torch.zeros_like(scores)
        for t in reversed(range(T)):
            nxt = values[:, t + 1] if t + 1 < T else torch.zeros_like(scores)
            delta = rewards[:, t] + gamma * nxt - values[:, t]
            last = delta + gamma * lam * last
            adv[:, t] = last
        returns = adv + values
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        return adv, returns

    def optimise(self, q, qm, r, old_lp, old_v, adv, ret, clip=0.2, vclip=0.2, vf_coef=0.5):
        a, P, B = self.args, q.shape[1], q.shape[0]
        mb = B // a.mini_batches
        ids, attn, pos = full_sequence(q, qm, r)
        for _ in range(a.ppo_epochs):
            perm = torch.randperm(B)
            for s in range(0, B, mb):
                i = perm[s:s + mb]
                x, m, p, rr = ids[i], attn[i], pos[i], r[i]
                if self.critic == "separate":
                    logits = self.policy(input_ids=x, attention_mask=m, position_ids=p).logits[:, P - 1:-1]
                    h = self.value.transformer(input_ids=x, attention_mask=m, position_ids=p).last_hidden_state
                    v = self.value.score(h[:, P - 1:-1]).squeeze(-1)
                else:
                    out = self.policy(input_ids=x, attention_mask=m, position_ids=p, output_hidden_states=True)
                    logits = out.logits[:, P - 1:-1]
                    v = self.v_head(out.hidden_states[-1][:, P - 1:-1]).squeeze(-1)
                lp = token_logprobs(logits, rr, a.temperature)
                ratio = (lp - old_lp[i]).exp()
                pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_clipped = old_v[i] + (v - old_v[i]).clamp(-vclip, vclip)
                vf = 0.5 * torch.max((v - ret[i]).square(), (v_clipped - ret[i]).square()).mean()
                (pg + vf_coef * vf).backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)

    def run(self):
        a = self.args
        phases = {"generate": [], "score": [], "advantages": [], "optimise": []}
        update_s = []
        for _ in range(a.updates):
            t0 = time.perf_counter()
            q, qm = self.next_batch()
            r, lp, values = self.generate(q, qm)
            t1 = time.perf_counter()
            ref_lp, v_sep, scores = self.score(q, qm, r)
            values = v_sep if values is None else values
            t2 = time.perf_counter()
            adv, ret = self.advantages(lp, ref_lp, values, scores)
            t3 = time.perf_counter()
            self.optimise(q, qm, r, lp, values, adv, ret)
            t4 = time.perf_counter()
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(v)
            update_s.append(t4 - t0)
        res = wl.timing_fields(update_s, a)
        res["phase_median_s"] = {k: round(wl.median_after_first(v), 4) for k, v in phases.items()}
        return res


def hf_generate_seconds(args, tok, prompt_ids, reps):
    from transformers import GenerationConfig

    policy = wl.no_dropout(wl.make_policy(tok, args)).eval()
    enc = tok.pad({"input_ids": prompt_ids[: args.batch]}, return_tensors="pt")
    cfg = GenerationConfig(max_new_tokens=args.response_length, min_new_tokens=args.response_length, do_sample=True,
                           temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
                           eos_token_id=None, bos_token_id=tok.bos_token_id)
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            out = policy.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], generation_config=cfg,
                                  return_dict_in_generate=True, output_scores=True)
            torch.stack(out.scores, 1)
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times[1:]), 4)


def main(argv=None):
    args = parse_args(argv)
    wl.setup_process(args)
    t_start = time.perf_counter()
    tok, words = wl.make_tokenizer(args.vocab, args.seed)
    texts = wl.make_prompt_texts(words, args.n_prompts, args.prompt_min, args.prompt_max, args.seed)
    prompt_ids = wl.make_prompt_ids(tok, texts)
    critics = ["separate", "shared"] if args.critic == "both" else [args.critic]
    result = {"bench": "floor", **wl.environment(), "config": vars(args)}
    for critic in critics:
        r = Floor(args, tok, prompt_ids, critic).run()
        if critic == critics[0]:
            result.update(r)  # the headline fields are the first (by default: separate) floor's
            result["critic"] = critic
        result[f"{critic}"] = r
    if args.hf_generate_reps:
        s = hf_generate_seconds(args, tok, prompt_ids, args.hf_generate_reps)
        result["hf_generate_with_scores_s"] = s
        result["hf_generate_tokens_per_s"] = round(args.batch * args.response_length / s, 1)
    result["peak_rss_mb"] = round(wl.peak_rss_mb(), 1)
    result["total_wall_s"] = round(time.perf_counter() - t_start, 2)
    wl.emit(result)


if __name__ == "__main__":
    main()
