"""The rollout batch: one dataclass of a rollout's per-token quantities, and how its fields pad.

Chapter 7 (The PPO trainer end to end) reads this module. A `Rollout` holds everything the
update needs about the sampled responses. Two places put rows of different widths together: the
rows of several processes (`distributed.gather_rollout`) and the rollouts of dynamic sampling
(`cat_rollouts`). Both pad each field by the one rule `padding` states: prompts on the left,
responses on the right, per-response fields not at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    """One batch of sampled responses and their per-token quantities (all (B, T) unless noted)."""

    prompts: list[str]
    responses: list[str]
    query_ids: torch.Tensor  # (B, P) left-padded prompt tokens
    query_mask: torch.Tensor  # (B, P) 1 on real prompt tokens
    response_ids: torch.Tensor  # (B, T) sampled tokens, pad after the stop token
    mask: torch.Tensor  # (B, T) 1 on real response tokens, stop token included
    old_logprobs: torch.Tensor  # log pi_old of the response tokens (the policy that sampled them)
    ref_logprobs: torch.Tensor  # log pi_ref of the same tokens
    values: torch.Tensor | None  # V(s_t) from the critic (None without one)
    entropy: torch.Tensor  # per-token entropy of pi_old
    scores: torch.Tensor  # (B,) raw scores from the reward
    ended: torch.Tensor  # (B,) whether the response stopped by itself
    group_ids: torch.Tensor  # (B,) index of the prompt each response answers
    sampler_logprobs: torch.Tensor | None = None  # log pi_s: the sampler's log-probs of the tokens (None if not kept)
    weights: torch.Tensor | None = None  # rollout-correction weights pi_old / pi_s, truncated or masked (None: off)

    def __len__(self) -> int:
        return self.response_ids.shape[0]


# the fields that are one value per response (no width to pad), and the lists of strings
PER_RESPONSE = ("scores", "ended", "group_ids")
TEXT = ("prompts", "responses")


def padding(name: str, pad_id: int) -> tuple[int, bool] | None:
    """How the field `name` of a `Rollout` is padded to a wider batch: (fill value, at the front),
    or None for a field with no width (one value per response, or a list of strings).

    Prompts are left-padded (every response starts at the same column), so their ids and mask
    are filled at the front; the response ids at the back with the pad token; every other
    per-token field at the back with 0, which the mask hides."""
    if name in PER_RESPONSE or name in TEXT:
        return None
    fill = pad_id if name in ("query_ids", "response_ids") else 0
    return fill, name in ("query_ids", "query_mask")


def pad_to(x: torch.Tensor, width: int, fill, front: bool) -> torch.Tensor:
    """(B, width) `x` (B, T <= width) with `fill` added at the front or at the back."""
    missing = width - x.shape[1]
    if missing == 0:
        return x
    block = torch.full((x.shape[0], missing), fill, dtype=x.dtype, device=x.device)
    return torch.cat([block, x] if front else [x, block], dim=1)


def cat_rollouts(parts: list[tuple[Rollout, torch.Tensor]], pad_id: int) -> Rollout:
    """The rows `rows` (a 1-D index tensor) of each rollout in `parts`, as one rollout.

    Each field is padded to the widest of the parts by `padding` (padding is masked out, and
    position ids count real tokens, so the log-probs do not change); group ids are renumbered
    so that groups from different rollouts stay apart. Used by dynamic sampling.
    """
    widths = {"query": max(ro.query_ids.shape[1] for ro, _ in parts), "response": max(ro.response_ids.shape[1] for ro, _ in parts)}
    fields: dict[str, list] = {}
    offset = 0
    for ro, rows in parts:
        idx = rows.tolist()
        for name in Rollout.__dataclass_fields__:
            value = getattr(ro, name)
            if name in TEXT:
                fields.setdefault(name, []).extend(value[i] for i in idx)
            elif name == "group_ids":
                _, groups = torch.unique(value[rows], return_inverse=True)
                fields.setdefault(name, []).append(groups + offset)
                offset += int(groups.max()) + 1 if len(idx) else 0
            elif value is None or name in PER_RESPONSE:
                fields.setdefault(name, []).append(None if value is None else value[rows])
            else:
                fill, front = padding(name, pad_id)
                fields.setdefault(name, []).append(pad_to(value[rows], widths["query" if front else "response"], fill, front))
    out = {}
    for name, values in fields.items():
        if name in TEXT:
            out[name] = values
        elif any(v is None for v in values):
            out[name] = None
        else:
            out[name] = torch.cat(values)
    return Rollout(**out)
