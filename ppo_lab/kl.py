"""KL divergence to the reference policy: per-token estimators and the exact value.

Chapter 5 (Reward shaping and the KL penalty) measures these. We want KL(pi || pi_ref) =
E_{x ~ pi}[log pi(x) - log pi_ref(x)] per token, but after sampling we only have the
log-probabilities of the sampled token, not the whole distributions. With
log r = log pi_ref(x) - log pi(x), x ~ pi, John Schulman's "Approximating KL divergence" (2020)
gives three estimators:

- k1 = -log r: unbiased, high variance, negative on about half the tokens;
- k2 = (log r)^2 / 2: always >= 0, biased (it is unbiased only to second order);
- k3 = (r - 1) - log r: unbiased and always >= 0, low variance when pi is close to pi_ref.

"abs" = |log r| is TRL's `kl_penalty="abs"` option. `full_kl` computes the exact per-token KL from
the full logits, the ground truth the book measures the estimators against.

Used as a loss (`kl.placement: loss`, chapter 10), what counts is an estimator's gradient with the
sample held fixed, which is not the gradient of the KL it estimates (Tang and Munos 2025):
`expected_loss_gradient` computes it exactly for one distribution, `kl_gradient` the two KLs'.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_float, check_range, check_response_dim, check_same_shape, check_tensor
from .logprobs import scaled_rows

#: The per-token KL estimators of `kl_penalty`, by name (`kl.estimator`).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probabilities.

    Args:
        logprobs: (B, T) log pi(x_t) of the tokens sampled from pi.
        ref_logprobs: (B, T) log pi_ref(x_t) of the same tokens.
        kl_estimator: "k1", "k2", "k3" or "abs" (see the module docstring).

    Returns:
        (B, T) per-token estimates (apply the response mask before averaging).

    k3 is computed as expm1(log r) - log r: the textbook form exp(log r) - 1 - log r cancels
    catastrophically for small |log r|, which is exactly the regime of a policy near its
    reference (at log r = 1e-4 in float32 it returns 1.7e-8 instead of 5.0e-9).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_float(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_response_dim("logprobs", logprobs)
    check_choice("KL estimator", kl_estimator, KL_ESTIMATORS)
    log_ratio = ref_logprobs - logprobs  # log r = log(pi_ref / pi)
    if kl_estimator == "k1":
        return -log_ratio
    if kl_estimator == "abs":
        return log_ratio.abs()
    if kl_estimator == "k2":
        return 0.5 * log_ratio**2
    # k3 >= 0 in exact arithmetic (e^x >= 1 + x); the clamp removes rounding noise below 0.
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact per-token KL(pi || pi_ref) from the two models' whole next-token distributions.

    Args:
        logits: (B, T, V) logits of the policy pi.
        ref_logits: (B, T, V) logits of the reference pi_ref.
        temperature: tau > 0; both distributions are softmax(logits / tau).

    Returns:
        (B, T) sum_v pi(v) * (log pi(v) - log pi_ref(v)), float32 for half-precision logits.

    Naive equivalent::

        p, q = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
        (p.exp() * (p - q)).sum(-1)
    """
    check_tensor("logits", logits, ndim=3)
    check_same_shape(logits=logits, ref_logits=ref_logits)
    check_float(logits=logits, ref_logits=ref_logits)
    temperature = check_range("temperature", temperature, low=0.0, low_open=True)
    out = []
    # One sequence at a time: two (T, V) log-softmax temporaries instead of four (B, T, V) ones.
    for row, ref_row in zip(scaled_rows(logits, temperature), scaled_rows(ref_logits, temperature)):
        logp = torch.log_softmax(row, dim=-1)
        logq = torch.log_softmax(ref_row, dim=-1)
        out.append((logp.exp() * (logp - logq)).sum(dim=-1))
    return torch.stack(out)  # (B, T)


def expected_loss_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, kl_estimator: str = "k3") -> torch.Tensor:
    """E_{y ~ pi}[d kl_penalty(y) / d logits] exactly, the sample y held fixed: the expected
    gradient of an estimator used as a loss, summed over the vocabulary.

    Args:
        logits: (N,) logits of pi over a vocabulary of N tokens (one position).
        ref_logits: (N,) logits of pi_ref.
        kl_estimator: "k1", "k2", "k3" or "abs".

    Returns:
        (N,) gradient with respect to `logits`. k1 gives 0, k2 the gradient of KL(pi || pi_ref),
        k3 that of KL(pi_ref || pi) (chapter 10; `kl_gradient` gives the two).
    """
    check_tensor("logits", logits, ndim=1)
    check_same_shape(logits=logits, ref_logits=ref_logits)
    check_float(logits=logits, ref_logits=ref_logits)
    z = logits.detach().clone().requires_grad_()
    logp, ref = torch.log_softmax(z, 0), torch.log_softmax(ref_logits.detach(), 0)
    per_token = kl_penalty(logp[:, None], ref[:, None], kl_estimator)[:, 0]  # (N,): the loss at each sample y
    weights = torch.softmax(logits.detach(), 0)  # the sample's probability, a constant
    # sum_y pi(y) grad k(y): one backward of the pi-weighted sum, since the weights carry no gradient
    (grad,) = torch.autograd.grad((weights * per_token).sum(), z)
    return grad


def kl_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, reverse: bool = True) -> torch.Tensor:
    """The gradient of KL(pi || pi_ref) (`reverse`, the KL the penalty means) or of KL(pi_ref || pi)
    with respect to the logits of pi = softmax(logits).

    Args:
        logits: (N,) logits of pi over a vocabulary of N tokens (one position).
        ref_logits: (N,) logits of pi_ref.
        reverse: which KL.

    Returns:
        (N,) gradient with respect to `logits`.
    """
    check_tensor("logits", logits, ndim=1)
    check_same_shape(logits=logits, ref_logits=ref_logits)
    z = logits.detach().clone().requires_grad_()
    p, q = torch.log_softmax(z, 0), torch.log_softmax(ref_logits.detach(), 0)
    kl = (p.exp() * (p - q)).sum() if reverse else (q.exp() * (q - p)).sum()
    return torch.autograd.grad(kl, z)[0]
