"""Slow, obviously correct references: plain Python loops over floats, one sequence at a time.

Each takes tensors, converts them to nested lists of Python floats (double precision), and
follows the textbook formula with no vectorisation, so that a mistake in an optimised
`ppo_lab` function cannot be mirrored here by sharing its code.
"""

import math


def rows(x):
    return [[float(v) for v in row] for row in x.tolist()]


def real_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m == 1]


def logprobs(logits, tokens, temperature=1.0):
    out = []
    for lrow, trow in zip(logits.double().tolist(), tokens.tolist()):
        out_row = []
        for dist, tok in zip(lrow, trow):
            z = [v / temperature for v in dist]
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            out_row.append(z[tok] - log_norm)
        out.append(out_row)
    return out


def entropy(logits, temperature=1.0):
    out = []
    for lrow in logits.double().tolist():
        out_row = []
        for dist in lrow:
            z = [v / temperature for v in dist]
            top = max(z)
            e = [math.exp(v - top) for v in z]
            s = sum(e)
            p = [v / s for v in e]
            out_row.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
        out.append(out_row)
    return out


def kl_exact(logits, ref_logits, temperature=1.0):
    out = []
    for lrow, rrow in zip(logits.double().tolist(), ref_logits.double().tolist()):
        out_row = []
        for a, b in zip(lrow, rrow):
            pa = _softmax([v / temperature for v in a])
            pb = _softmax([v / temperature for v in b])
            out_row.append(sum(p * (math.log(p) - math.log(q)) for p, q in zip(pa, pb) if p > 0))
        out.append(out_row)
    return out


def _softmax(z):
    top = max(z)
    e = [math.exp(v - top) for v in z]
    s = sum(e)
    return [v / s for v in e]


def real_values(x, mask):
    return [v for xr, mr in zip(rows(x), rows(mask)) for v, m in zip(xr, mr) if m == 1]


def mean(values):
    return sum(values) / len(values)


def var(values, unbiased=True):
    mu = mean(values)
    return sum((v - mu) ** 2 for v in values) / (len(values) - (1 if unbiased else 0))


def gae(rewards, values, mask, gamma, lam):
    """Per sequence: compact the real tokens, run the textbook recursion, scatter back."""
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(rows(rewards), rows(values), rows(mask)):
        idx = real_positions(m_row)
        r = [r_row[t] for t in idx]
        v = [v_row[t] for t in idx]
        n = len(idx)
        adv = [0.0] * n
        running = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_v - v[t]
            running = delta + gamma * lam * running
            adv[t] = running
        a_row = [0.0] * len(m_row)
        g_row = [0.0] * len(m_row)
        for k, t in enumerate(idx):
            a_row[t] = adv[k]
            g_row[t] = adv[k] + v[k]
        adv_out.append(a_row)
        ret_out.append(g_row)
    return adv_out, ret_out


def reward_to_go(rewards, mask, gamma):
    """G_t as an explicit double sum over the real tokens after t."""
    out = []
    for r_row, m_row in zip(rows(rewards), rows(mask)):
        idx = real_positions(m_row)
        g_row = [0.0] * len(m_row)
        for k, t in enumerate(idx):
            g_row[t] = sum(gamma ** (j - k) * r_row[idx[j]] for j in range(k, len(idx)))
        out.append(g_row)
    return out


def shape_rewards(scores, logprobs_, ref_logprobs, mask, kl_coef, kind, score_clip):
    out = []
    for s, lp_row, ref_row, m_row in zip(
        scores.tolist(), rows(logprobs_), rows(ref_logprobs), rows(mask)
    ):
        if score_clip is not None:
            s = max(-score_clip, min(score_clip, s))
        idx = real_positions(m_row)
        r_row = [0.0] * len(m_row)
        for t in idx:
            r_row[t] = -kl_coef * kl_estimate(lp_row[t], ref_row[t], kind)
        r_row[idx[-1]] += s
        out.append(r_row)
    return out


def kl_estimate(lp, ref, kind):
    log_r = ref - lp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return math.expm1(log_r) - log_r
    if kind == "abs":
        return abs(log_r)
    raise ValueError(kind)


def policy_loss_per_token(lp, old, adv, eps_low, eps_high, dual_clip):
    ratio = math.exp(lp - old)
    clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(-adv * ratio, -adv * clipped_ratio)
    if dual_clip is not None and adv < 0:
        loss = min(loss, -dual_clip * adv)
    return loss


def aggregate(per_token, mask, mode, norm_length=None):
    """per_token, mask: nested lists."""
    if mode == "token-mean":
        vals = [v for pr, mr in zip(per_token, mask) for v, m in zip(pr, mr) if m == 1]
        return sum(vals) / len(vals)
    seq_sums = [sum(v for v, m in zip(pr, mr) if m == 1) for pr, mr in zip(per_token, mask)]
    if mode == "seq-mean-token-sum":
        return mean(seq_sums)
    if mode == "seq-mean-token-mean":
        return mean([s / sum(mr) for s, mr in zip(seq_sums, mask)])
    if mode == "seq-mean-token-sum-norm":
        length = len(mask[0]) if norm_length is None else norm_length
        return mean(seq_sums) / length
    raise ValueError(mode)
