"""Mixture-of-experts routing in the pipeline: decisions kept for the recomputation, and HF's
router auxiliary (load-balancing) loss of the whole batch.

**Routing kept.** Each decoder layer runs twice in training (forward pass, then the
recomputation in the backward pass). The router's top-k choice is made once, in the forward
pass; the indices are kept on the host (``save_for_recompute``) and the recomputation uses them:
it recomputes only the router's probabilities (with autograd) and gathers the routing weights at
the kept indices, so both runs route every token identically and the recomputation has no
data-dependent decision of its own.

**Auxiliary loss of the whole batch.** HF's ``load_balancing_loss_func`` (Switch Transformer,
eqs. 4-6) over all MoE layers ``l`` and tokens ``t`` of the batch (padding excluded by the
attention mask ``m_t``) is::

    aux = E * sum_e (A_e / R) * (P_e / R),   A_e = sum_{l,t} m_t [e in topk_l(t)],
                                             P_e = sum_{l,t} m_t softmax(logits_l(t))_e,
                                             R   = sum_{l,t} m_t

``A`` and ``R`` are counts (no gradient). Once they are known, ``aux`` is linear in the router
probabilities, so it splits exactly over microbatches and layers: the gradient reaching layer
``l``'s router on microbatch ``k`` is that of ``E / R^2 * sum_e A_e * P_e^(l,k)``. The forward
pass gathers ``A``, ``P`` and ``R`` over every microbatch; every recomputation runs after the
whole forward pass (the backward of a stage follows the forward of all earlier stages), so it
knows them, and adds that gradient to its router through :class:`_AddAuxGrad` (the "auxiliary
loss auto-scaler" of Megatron-LM's MoE layer: identity forward, a constant gradient for the
auxiliary term in backward, read when the backward runs). The loss value
``router_aux_loss_coef * aux`` is computed once from the gathered sums at the end of the pass.
Because the gradient needs the whole forward pass, a MoE layer cannot share the last stage
(which runs forward and backward microbatch by microbatch) when the auxiliary loss is on;
:func:`roundpipe.wrap_model_to_roundpipe` checks that.

**Stages that do not recompute** (:mod:`roundpipe.planner`) run each decoder layer once, with
autograd, in the forward pass: the router's own routing is the one differentiated, nothing is
kept for a recomputation, and the auxiliary-loss gradient is attached there (its backward runs
after the whole forward pass, when ``A`` and ``R`` are known).

Per-family code: the recomputed routing weights follow the Qwen3-MoE router
(``softmax`` in fp32, top-k, renormalised when ``norm_topk_prob``, cast to the logits' dtype),
shared by the Qwen2/Qwen3-MoE, Mixtral and OLMoE routers of transformers 5.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import nn

from .. import recompute
from ..transfer import current_io

_local = threading.local()


class _AddAuxGrad(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, passes ``x``'s gradient through and gives ``sums``
    (one router's mask-weighted probability sums over its tokens, fp32 ``(E,)``) the gradient
    of the scaled auxiliary loss, :meth:`RouterStats.grad_scale`, read then (so it may be
    attached before the forward pass has gathered every router's counts). Technique of
    Megatron-LM's ``MoEAuxLossAutoScaler``."""

    @staticmethod
    def forward(ctx, x, sums, stats, coef):
        ctx.stats, ctx.coef, ctx.device = stats, coef, sums.device
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.stats.grad_scale(ctx.device, ctx.coef), None, None


class RouterStats:
    """Routing sums of one ``forward``/``forward_backward`` call over all MoE layers and
    microbatches, on the host in fp32: ``counts[e]`` (A), ``probs[e]`` (P, detached) and
    ``rows`` (R), as defined in this module's docstring. Filled by the forward pass (worker
    threads, under a lock); read by the recomputations and at the end of the call.

    Each router's sums are copied to the host through the device I/O of the visit running it
    (:func:`roundpipe.transfer.current_io`): on CUDA asynchronously, into pinned memory, with
    an event, so the forward pass never makes the host wait for the device; they are added up
    (in the order the routers ran) when first read, by which time the copies are long done.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.lock = threading.Lock()
        self._sums = torch.zeros(2 * num_experts + 1, dtype=torch.float32)
        self._pending: list[tuple[torch.Tensor, Any, Any]] = []  # (host, event, io)
        self._scale: dict[torch.device, torch.Tensor] = {}

    def add(self, stats: torch.Tensor) -> None:
        """Adds one router's ``[counts (E), probs (E), rows (1)]`` (any device)."""
        host, event, io = _to_host(stats)
        with self.lock:
            self._pending.append((host, event, io))

    def _folded(self) -> torch.Tensor:
        """The sums with every pending router's added (under :attr:`lock`)."""
        for host, event, io in self._pending:
            if io is not None:
                io.host_wait(event)
            self._sums += host
        self._pending.clear()
        return self._sums

    @property
    def counts(self) -> torch.Tensor:
        with self.lock:
            return self._folded()[:self.num_experts]

    @property
    def probs(self) -> torch.Tensor:
        with self.lock:
            return self._folded()[self.num_experts:2 * self.num_experts]

    @property
    def rows(self) -> torch.Tensor:
        with self.lock:
            return self._folded()[2 * self.num_experts]

    def grad_scale(self, device: torch.device, coef: float) -> torch.Tensor:
        """``coef * E / R^2 * A`` on ``device`` (fp32, (E,)): the gradient of the scaled
        auxiliary loss w.r.t. one router's mask-weighted probability sums."""
        with self.lock:
            if device not in self._scale:
                sums, e = self._folded(), self.num_experts
                rows = sums[2 * e]
                scale = coef * e / (rows * rows) * sums[:e]
                self._scale[device] = scale.to(device, non_blocking=device.type == "cuda")
            return self._scale[device]

    def aux_loss(self) -> torch.Tensor:
        """HF's ``load_balancing_loss_func`` value for the whole call (fp32, 0-dim, host)."""
        counts, probs, rows = self.counts, self.probs, self.rows
        return self.num_experts * torch.sum((counts / rows) * (probs / rows))


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
    """``(host copy, event, io)`` of a device tensor made inside a layer: through the running
    visit's device I/O (no host wait on CUDA: the event marks the copy), or, outside a visit,
    copied now (event and io None)."""
    io = current_io()
    if io is None:
        return t.to("cpu"), None, None
    host, event = io.to_host(t, "activation")
    return host, event, io


def _to_device(kept: tuple[torch.Tensor, Any, Any], device: torch.device) -> torch.Tensor:
    """What :func:`_to_host` made, back on ``device`` for a recomputation (on CUDA the copy
    waits for the download on the device, not on the host)."""
    host, event, io = kept
    io = current_io() or io
    if io is None:
        return host.to(device)
    return io.to_device(host, event, "activation")


class _LayerRouting:
    """What the routers of the running decoder layer need: the call's stats, the flattened
    attention mask (or None), and the routing kept from the forward pass (recomputation)."""

    def __init__(self, stats: RouterStats, mask: Optional[torch.Tensor], coef: Optional[float],
                 recomputing: bool, kept: list, saves: bool) -> None:
        self.stats, self.mask, self.coef = stats, mask, coef
        self.recomputing, self.kept, self.made = recomputing, kept, []
        self.saves = saves  # the routing is kept for a recomputation


class routing_scope:
    """Context in which a decoder layer runs: its routers (hooked by :func:`hook_routers`) use
    ``stats`` and keep or reuse their decisions. Outside it the hooks do nothing, so the model
    itself behaves as before wrapping. ``stats`` None: no sums gathered (no auxiliary loss);
    ``coef`` None: no auxiliary-loss gradient."""

    def __init__(self, stats: Optional[RouterStats], attention_mask: Optional[torch.Tensor],
                 coef: Optional[float]) -> None:
        self.stats, self.coef = stats, coef
        self.mask = None if attention_mask is None else attention_mask.reshape(-1)

    def __enter__(self):
        rec = recompute.doing_recompute()
        kept = list(recompute.get_recompute_data()) if rec else []
        self.outer = getattr(_local, "routing", None)
        self.ctx = _LayerRouting(self.stats, self.mask, self.coef, rec, kept,
                                 recompute.will_recompute())
        _local.routing = self.ctx
        return self

    def __exit__(self, *exc):
        _local.routing = self.outer
        if exc[0] is None and self.ctx.saves:
            recompute.save_for_recompute(*self.ctx.made)


def router_hook(router: nn.Module, inputs: tuple, output: Any) -> Any:
    """Forward hook of a router: inside :class:`routing_scope`, keeps the top-k choice of the
    forward pass and reuses it in the recomputation (with the auxiliary-loss gradient added);
    elsewhere returns the output unchanged."""
    ctx: Optional[_LayerRouting] = getattr(_local, "routing", None)
    if ctx is None:
        return output
    logits, weights, indices = output
    if not ctx.recomputing:
        if ctx.saves:
            ctx.made.append(_to_host(indices.detach()))
        if ctx.stats is not None:
            ctx.stats.add(_router_sums(logits.detach(), indices, ctx.mask, ctx.stats.num_experts))
        if not torch.is_grad_enabled():  # a forward visit: the recomputation differentiates
            return output
    else:
        indices = _to_device(ctx.kept.pop(0), logits.device)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
    if ctx.coef is not None and ctx.stats is not None and torch.is_grad_enabled():
        # HF's aux loss takes the softmax in the logits' dtype, then sums in fp32
        p = torch.softmax(logits, dim=-1).float()
        if ctx.mask is not None:
            p = p * ctx.mask.to(device=p.device, dtype=p.dtype).unsqueeze(1)
        weights = _AddAuxGrad.apply(weights, p.sum(0), ctx.stats, ctx.coef)
    return logits, weights, indices


def _router_sums(logits: torch.Tensor, indices: torch.Tensor, mask: Optional[torch.Tensor],
                 num_experts: int) -> torch.Tensor:
    """``[A (E), P (E), R (1)]`` of one router on one microbatch, as HF's
    ``load_balancing_loss_func`` accumulates them (fp32, logits' device)."""
    p = torch.softmax(logits, dim=-1).float()
    w = (torch.ones(p.shape[0], dtype=torch.float32, device=p.device) if mask is None
         else mask.to(device=p.device, dtype=torch.float32))
    counts = torch.zeros(num_experts, dtype=torch.float32, device=p.device)
    counts.scatter_add_(0, indices.reshape(-1), w.repeat_interleave(indices.shape[-1]))
    return torch.cat([counts, (p * w.unsqueeze(1)).sum(0), w.sum().reshape(1)])


def find_router_class(model: nn.Module) -> Optional[type]:
    """The module class whose output 0 HF records as ``router_logits`` (from the model's
    ``_can_record_outputs``), or None for a dense model."""
    for cls in type(model).__mro__:
        spec = cls.__dict__.get("_can_record_outputs")
        if spec and "router_logits" in spec:
            rec = spec["router_logits"]
            target = getattr(rec, "target_class", rec)
            return target if isinstance(target, type) else None
    return None


def find_routers(layer: nn.Module, router_cls: type) -> list:
    """The routers of a decoder layer (their forward hook is :func:`router_hook`).

    Raises:
        TypeError: a router without the ``top_k`` / ``norm_topk_prob`` attributes of the
            supported (Qwen3-MoE style) routers, or with the score-correction bias, routed
            scaling or expert groups of a sigmoid router (DeepSeek-V3 style, e.g.
            MiMo-V2-Flash): :func:`router_hook` recomputes softmax weights for the kept
            experts, which would silently give such a router other gradients.
    """
    found = []
    for name, m in layer.named_modules():
        if isinstance(m, router_cls):
            sigmoid = [a for a in _SIGMOID_ROUTER_ATTRS if hasattr(m, a)]
            if not (hasattr(m, "top_k") and hasattr(m, "norm_topk_prob")) or sigmoid:
                why = f" (it has {', '.join(sigmoid)})" if sigmoid else ""
                raise TypeError(f"wrap_model_to_roundpipe: the MoE router {name!r} "
                                f"({type(m).__name__}) is not a top-k softmax router with "
                                f"top_k and norm_topk_prob (Qwen3-MoE style){why}; not "
                                "supported")
            found.append(m)
    return found


# attributes of sigmoid / grouped routers (DeepSeek-V3 style), whose weights are not the
# softmax of the kept experts' logits
_SIGMOID_ROUTER_ATTRS = ("e_score_correction_bias", "routed_scaling_factor", "num_group",
                         "n_group", "topk_group")
