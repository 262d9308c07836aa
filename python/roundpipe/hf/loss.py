"""The causal-LM loss computed in chunks of tokens, without the full logits.

``lm_head`` followed by cross-entropy over a 150k-token vocabulary needs ``tokens x vocab``
fp32 logits (and as much again for their gradient): for 8k tokens that is 5 GB, more than the
rest of a decoder layer. :func:`chunked_cross_entropy_sum` computes the same value and gradients
one chunk of tokens at a time, so at most ``chunk x vocab`` logits exist at once.

Numerics are those of Hugging Face's ``ForCausalLMLoss`` (``transformers.loss.loss_utils``):
the logits are computed in the model's dtype (``F.linear``), upcast to fp32, and the
cross-entropy with ``ignore_index=-100`` is taken in fp32. The gradient is the textbook one of
softmax cross-entropy, ``d loss / d logits = softmax(logits) - one_hot(target)`` (zero for ignored
tokens); it is computed in the forward pass, chunk by chunk, right after the chunk's logits
(the approach of Liger-Kernel's fused linear cross-entropy), so the logits are never recomputed;
the weight gradient is accumulated over the chunks in fp32 and cast to the weight's dtype once.

The same pass can count, without a second read of the logits, what TRL's ``SFTTrainer`` logs
as ``mean_token_accuracy`` and ``entropy`` (``trl.trainer.utils.add_fused_lm_head``): the scored
tokens whose target is the logits' top-1 (the first maximum, as ``argmax``) and the entropy of
each scored token's next-token distribution, ``logsumexp(z) - sum_v softmax(z)_v z_v`` in fp32
(:func:`chunked_cross_entropy_sum` with ``with_stats=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..pipeline.meter import fixed_size

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenStats:
    """What the built-in loss counted over a call's scored tokens (the labels other than -100,
    after HF's shift), as TRL's ``SFTTrainer`` counts them for its logs: ``tokens`` scored,
    ``top1`` of them whose target was the top-1 logit, ``entropy`` the sum of their next-token
    distributions' entropies in nats. ``mean_token_accuracy = top1 / tokens`` and
    ``entropy / tokens`` are TRL's metrics (0 when ``tokens`` is 0, as TRL logs them)."""

    tokens: int
    top1: int
    entropy: float

    @property
    def mean_token_accuracy(self) -> float:
        return self.top1 / self.tokens if self.tokens else 0.0

    @property
    def mean_entropy(self) -> float:
        return self.entropy / self.tokens if self.tokens else 0.0


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position ``t`` is scored against ``labels[..., t + 1]``; the last
    position against ``-100`` (ignored). Same shape as ``labels``."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_items(labels: torch.Tensor) -> torch.Tensor:
    """The number of scored tokens of a batch of (unshifted) labels: HF's ``num_items_in_batch``
    (int64, 0-dim, on the labels' device)."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> TokenStats:
    """:class:`TokenStats` of full logits ``(B, S, V)`` against unshifted ``labels`` ``(B, S)``
    (HF's shift, -100 ignored), in fp32: what the chunked loss counts, for a pass that has
    the logits anyway."""
    targets = shift_labels(labels.to(logits.device))
    valid = targets != IGNORE_INDEX
    z = logits.float()
    log_p = torch.log_softmax(z, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    hits = valid & (z.argmax(dim=-1) == targets)
    return TokenStats(int(valid.sum()), int(hits.sum()), float(entropy[valid].sum()))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T + bias, target), gradients computed in forward;
    also the scored tokens' top-1 hits (int64) and summed entropy (fp32), without gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
        entropy = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if need_b else None)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            y = targets[start:start + chunk]
            logits = F.linear(h, weight, bias).float()
            valid = y != IGNORE_INDEX
            safe = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            hits += (valid & (logits.argmax(dim=-1) == y)).sum()
            g = torch.softmax(logits, dim=-1)
            # sum_v p_v z_v, row by row, without a (chunk x V) product
            expected = torch.bmm(g.unsqueeze(1), logits.unsqueeze(2)).reshape(-1)
            entropy += torch.where(valid, lse - expected, 0.0).sum()
            del logits
            if need_h or need_w or need_b:
                g.scatter_add_(1, safe.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
                g.mul_(valid.unsqueeze(1))
                if need_h:
                    grad_h[start:start + chunk] = g.to(weight.dtype) @ weight
                if need_w:
                    grad_w.addmm_(g.t(), h.float())
                if need_b:
                    grad_b += g.sum(0)
        # the weight's (and bias') gradient is vocabulary-sized whatever the tokens: the
        # stage planner's meter counts it once, not per token
        ctx.save_for_backward(grad_h, fixed_size(grad_w), fixed_size(grad_b))
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(hits, entropy)
        return total, hits, entropy

    @staticmethod
    def backward(ctx, grad_total, _grad_hits=None, _grad_entropy=None):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        out_h = out_w = out_b = None
        if grad_h is not None:
            out_h = grad_h * grad_total.to(grad_h.dtype)
        # in place: the saved sums are used once (a float32 copy of a vocabulary-sized
        # gradient, 2.1 GB for Llama 3 8B's, would be another transient on the device)
        if grad_w is not None:
            out_w = grad_w.mul_(grad_total).to(w_dtype)
        if grad_b is not None:
            out_b = grad_b.mul_(grad_total).to(b_dtype)
        return out_h, out_w, out_b, None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor], targets: torch.Tensor,
                              chunk_size: int, with_stats: bool = False):
    """``sum_t CE(hidden[t] @ weight.T + bias, targets[t])`` over the tokens whose target is not
    -100, in chunks of ``chunk_size`` tokens.

    Args:
        hidden: ``(..., H)`` final hidden states (after the final norm), model dtype, on the
            compute device.
        weight: ``(V, H)`` the ``lm_head`` weight (same dtype and device).
        bias: ``(V,)`` or None.
        targets: ``(...)`` integer targets (already shifted, see :func:`shift_labels`), -100
            for tokens not scored.
        chunk_size: tokens per chunk (>= 1); at most ``chunk_size x V`` fp32 logits, and as
            many for their gradient, exist at a time.
        with_stats: also return the top-1 hits and the summed entropy (see the module
            docstring).

    Returns:
        The summed loss, fp32, 0-dim. Divide by the number of scored tokens for HF's mean.
        Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``, once: the gradients are
        computed in the forward and scaled in place in the backward, so a second backward
        through the same graph (``retain_graph=True``) raises autograd's in-place error.
        With ``with_stats``:
        ``(loss, hits, entropy)``, ``hits`` the scored tokens whose target is the top-1 logit
        (int64, 0-dim), ``entropy`` the summed entropy of their distributions in nats (fp32,
        0-dim), both without gradient, on ``hidden``'s device.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(device=h.device, dtype=torch.long)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"targets has {y.shape[0]} tokens, hidden {h.shape[0]}")
    loss, hits, entropy = _ChunkedLinearCrossEntropy.apply(h, weight, bias, y, chunk_size)
    return (loss, hits, entropy) if with_stats else loss
