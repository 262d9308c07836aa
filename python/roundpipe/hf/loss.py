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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position ``t`` is scored against ``labels[..., t + 1]``; the last
    position against ``-100`` (ignored). Same shape as ``labels``."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def count_items(labels: torch.Tensor) -> torch.Tensor:
    """The number of scored tokens of a batch of (unshifted) labels: HF's ``num_items_in_batch``
    (int64, 0-dim, on the labels' device)."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T + bias, target), gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
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
            if need_h or need_w or need_b:
                g = torch.softmax(logits, dim=-1)       # logits' memory reused for the gradient
                del logits
                g.scatter_add_(1, safe.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
                g.mul_(valid.unsqueeze(1))
                if need_h:
                    grad_h[start:start + chunk] = g.to(weight.dtype) @ weight
                if need_w:
                    grad_w.addmm_(g.t(), h.float())
                if need_b:
                    grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        out_h = out_w = out_b = None
        if grad_h is not None:
            out_h = grad_h * grad_total.to(grad_h.dtype)
        if grad_w is not None:
            out_w = (grad_w * grad_total).to(w_dtype)
        if grad_b is not None:
            out_b = (grad_b * grad_total).to(b_dtype)
        return out_h, out_w, out_b, None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor], targets: torch.Tensor,
                              chunk_size: int) -> torch.Tensor:
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

    Returns:
        The summed loss, fp32, 0-dim. Divide by the number of scored tokens for HF's mean.
        Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(device=h.device, dtype=torch.long)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"targets has {y.shape[0]} tokens, hidden {h.shape[0]}")
    return _ChunkedLinearCrossEntropy.apply(h, weight, bias, y, chunk_size)
