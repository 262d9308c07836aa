"""Loud failures for the habits of a plain PyTorch loop, which would otherwise train nothing
without a word:

- ``loss.backward()`` on the loss :meth:`RoundPipe.forward_backward` returned (its backward
  already ran), or on a loss computed from :meth:`RoundPipe.forward`'s outputs in training
  mode (the pipeline ran without autograd): those tensors are :class:`Finished` tensors, whose
  ``backward()`` raises an error naming ``forward_backward`` instead of torch's generic "does
  not require grad" (:func:`finished`). They are otherwise plain detached tensors (``.numpy()``,
  ``+=``, in-place ops, ``copy.deepcopy``, formatting all work), and what is computed from them
  stays a ``Finished`` tensor, so ``F.mse_loss(model(x), y).backward()`` and
  ``scaler.scale(loss).backward()`` raise the same way; ``torch.save`` writes them as plain
  tensors (``torch.load``'s default ``weights_only=True`` reads them);
- ``opt.step()`` outside ``model.step(opt)`` on an optimizer over a RoundPipe's optimizer
  copies: their gradients are held by the wrapper until ``model.step``, so the step would
  change nothing and the gradients would keep accumulating (also inside another RoundPipe's
  step function: each model's step applies its own gradients); and stepping, anywhere, an
  optimizer over a RoundPipe's model copies (built on ``model.parameters()`` outside
  ``OptimizerCtx`` while the optimizer copies are separate), which never get a gradient. A
  global optimizer step pre-hook (installed when the first RoundPipe is built, never at
  import) raises instead (:func:`register_copies`, :func:`inside_step`);
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (or ``clip_grad_value_``,
  ``clip_grads_with_norm_``: torch.nn.utils' functions that read ``.grad``) before
  ``model.step``: the gradients are held by the wrapper until its step, so torch would measure
  a norm of 0 and clip nothing (or fail inside on an empty list). Installed with the step
  pre-hook, :func:`_guarded_grad_util` stands in for each (under ``torch.nn.utils`` and
  ``torch.nn.utils.clip_grad``): over a live RoundPipe's parameters outside its step it
  raises, naming where the call belongs (``max_grad_norm=``, a step function); for every
  other call it is torch's function, called as it was.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from typing import Any, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_BACKWARD_MESSAGE = (
    "RoundPipe: this tensor came out of a RoundPipe model, whose pipeline runs the backward "
    "itself: call loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn) "
    "instead of model(x) + loss.backward() (and pass grad_scaler= to forward_backward and "
    "model.step instead of scaler.scale(loss).backward()); the loss it returns is already "
    "backpropagated, read it with loss.item()")


class Finished(torch.Tensor):
    """A tensor that came out of a RoundPipe call without a graph (the loss
    ``forward_backward`` returned, ``model(x)`` in training mode): ``backward()`` on it, or on
    anything computed from it that does not require grad, raises ``RuntimeError`` naming
    ``forward_backward`` (the habit of a plain loop would otherwise fail with torch's generic
    message, or, for a loss, train nothing). Where a result does require grad (it also depends
    on a plain model's parameters, e.g. a frozen RoundPipe teacher's output in a plain
    student's loss) ``backward()`` is torch's. Every other operation is a plain tensor's, and
    its results are ``Finished`` tensors too (``__torch_function__``)."""

    def backward(self, *args: Any, **kwargs: Any) -> None:
        if not self.requires_grad:
            raise RuntimeError(_BACKWARD_MESSAGE)
        return super().backward(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "Finished":
        return self.clone()

    def __reduce_ex__(self, protocol: int):
        """Pickled (``torch.save``, ``pickle``, multiprocessing) as the plain tensor it views:
        ``torch.load``'s default ``weights_only=True`` reads it, and reading it needs no
        roundpipe. The loaded tensor is a plain ``torch.Tensor``."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __copy__(self) -> "Finished":
        """``copy.copy``: still a ``Finished`` tensor (as before :meth:`__reduce_ex__`, which
        ``copy.copy`` would otherwise use)."""
        return copy.copy(self.as_subclass(torch.Tensor)).as_subclass(Finished)

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:  # f"{loss:.3f}", as for a plain 0-dim tensor
            return self.item().__format__(spec)
        return torch.Tensor.__format__(self.as_subclass(torch.Tensor), spec)


def finished(t: Any) -> Any:
    """``t`` (a tensor, or a tree of them) with each floating tensor viewed as a
    :class:`Finished` tensor (the same memory, dtype and device: no copy); other leaves are
    returned as they are."""
    from .torch_private import tree_map

    def wrap(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not isinstance(x, Finished):
            return x.detach().as_subclass(Finished)
        return x

    return tree_map(wrap, t)


# --- opt.step() outside model.step, optimizers over the model copies -----------------------------

_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (weakref to owner, kind)
_holds: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (key, _held)
_labels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # owner -> its RoundPipe's name
_local = threading.local()  # owners: the owners whose step the thread runs, innermost last
_installed = False
_install_lock = threading.Lock()

HOW = ("build it on the optimizer copies: opt = roundpipe.optim.AdamW(model.optim_parameters(), "
       "...), or create it inside `with roundpipe.OptimizerCtx():`, where model.parameters() "
       "returns them, and step it with model.step(opt)")


def register_copies(optim: Iterable[torch.Tensor], model: Iterable[torch.Tensor],
                    owner: Any, label: str = "a RoundPipe") -> None:
    """Marks ``optim`` as the optimizer copies and ``model`` as the model copies that have a
    separate optimizer copy, of ``owner`` (a RoundPipe's optimizer side, held weakly: a dead
    owner's tensors are free again; ``label`` names its RoundPipe in errors), and installs the
    step pre-hook."""
    global _installed
    ref = weakref.ref(owner)
    _labels[owner] = label
    for p in model:
        _copies[p] = (ref, "model")
    for p in optim:
        _copies[p] = (ref, "optim")
    with _install_lock:
        if not _installed:
            register_optimizer_step_pre_hook(_refuse)
            _install_clip_guard()
            _installed = True


@contextlib.contextmanager
def inside_step(owner: Any):
    """The calling thread runs ``owner``'s step (nestable: a step function may run another
    RoundPipe's step): optimizers over ``owner``'s optimizer copies may step."""
    stack = _local.__dict__.setdefault("owners", [])
    stack.append(owner)
    try:
        yield
    finally:
        stack.pop()


def _kind(p: Any) -> Any:
    """``"model"`` / ``"optim"`` when ``p`` is a live RoundPipe's model / optimizer copy, else
    None."""
    try:
        entry = _copies.get(p)
    except TypeError:  # not a tensor
        return None
    return entry[1] if entry is not None and entry[0]() is not None else None


def holds(opt: torch.optim.Optimizer) -> Any:
    """``"model"`` when ``opt`` holds a live RoundPipe's model copy (one with a separate
    optimizer copy), else ``"optim"`` when it holds an optimizer copy, else None. Cached per
    optimizer until its parameter lists change."""
    return _held(opt)[0]


def _held(opt: torch.optim.Optimizer) -> tuple:
    """``(holds(opt), the weak references to the owners of the optimizer copies it holds)``,
    cached per optimizer until its parameter lists change."""
    key = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
    cached = _holds.get(opt)
    if cached is not None and cached[0] == key:
        return cached[1]
    kind, owners = None, []
    for g in opt.param_groups:
        for p in g["params"]:
            entry = _copies.get(p)
            if entry is None or entry[0]() is None:
                continue
            if entry[1] == "model":
                kind = "model"
            else:
                kind = kind or "optim"
                if all(r is not entry[0] for r in owners):
                    owners.append(entry[0])
    found = (kind, tuple(owners))
    try:
        _holds[opt] = (key, found)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return found


def _refuse(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    kind, owners = _held(opt)
    if kind == "model":
        raise TypeError(
            f"{type(opt).__name__}.step(): this optimizer holds a RoundPipe model's model copies "
            "(built on model.parameters() outside OptimizerCtx), which are only what the devices "
            f"compute with: they get no gradient and stepping them trains nothing; {HOW}")
    if kind != "optim":
        return
    stepping = getattr(_local, "owners", None)
    if not stepping:
        raise RuntimeError(
            f"{type(opt).__name__}.step() was called on an optimizer over a RoundPipe model's "
            "optimizer copies outside model.step(): the wrapper holds the accumulated gradients "
            "until its own step, so this step would change nothing. Call model.step(opt) "
            "instead of opt.step(); opt.zero_grad() (or model.step(lambda: (opt.step(), "
            "opt.zero_grad())) with a step function of your own); the accumulated gradients "
            "are kept for it")
    for ref in owners:
        other = ref()
        if other is not None and all(other is not s for s in stepping):
            raise RuntimeError(
                f"{type(opt).__name__}.step() was called inside the step function of "
                f"{_labels.get(stepping[-1], 'a RoundPipe')} on an optimizer over the optimizer "
                f"copies of another model, {_labels.get(other, 'a RoundPipe')}: that model holds "
                "its own accumulated gradients until its own step, so this step would change "
                "nothing there. Step each model's optimizer through its own model.step(opt) "
                "(one optimizer per model)")


_refuse.roundpipe_guard = True  # ours: not a user hook (see Steps.layerwise)


# torch.nn.utils' functions that read the .grad of the parameters they are given, and what a
# call over a RoundPipe's parameters outside its step should do instead
_GRAD_UTILS = {
    "clip_grad_norm_": (
        "would measure a norm of 0 and clip nothing. Pass max_grad_norm= to the step instead: "
        "model.step(opt, max_grad_norm=1.0) (in exact mode forward_backward(..., optimizer=opt, "
        "max_grad_norm=1.0); RoundPipeTrainer: TrainingArguments(max_grad_norm=...)), which "
        "clips by the global norm with clip_grad_norm_'s arithmetic; "
        "model.last_step_stats().grad_norm is the norm it measured", "1.0"),
    "clip_grads_with_norm_": (
        "would scale no gradient. Pass max_grad_norm= to the step instead: "
        "model.step(opt, max_grad_norm=1.0), which clips by the global norm", "1.0, total_norm"),
    "clip_grad_value_": (
        "would find no gradient to clamp (torch then fails on an empty list)", "0.5"),
}
_GRAD_MESSAGE = (
    "torch.nn.utils.{name} was called on a RoundPipe model's {what} outside model.step(): the "
    "wrapper holds the accumulated gradients until its own step, so torch {why}. Inside a step "
    "function, {name}(model.parameters(), ...) works as in a plain loop: model.step(lambda: "
    "({name}(model.parameters(), {args}), opt.step(), opt.zero_grad()))")


def _inside_owners_steps(params: list) -> bool:
    """Whether the calling thread runs the step of every live RoundPipe whose optimizer copy is
    among ``params`` (their gradients are theirs to apply)."""
    stepping = getattr(_local, "owners", None) or []
    for p in params:
        entry = _copies.get(p) if isinstance(p, torch.Tensor) else None
        owner = entry[0]() if entry is not None and entry[1] == "optim" else None
        if owner is not None and all(owner is not s for s in stepping):
            return False
    return True


def _guarded_grad_util(original, name: str):
    """``original`` (torch's ``torch.nn.utils.<name>``, one of :data:`_GRAD_UTILS`), raising
    ``RuntimeError`` (see :data:`_GRAD_MESSAGE`) before anything is read or changed when
    ``parameters`` holds a live RoundPipe's model copy, or its optimizer copy outside its
    step; otherwise torch's function, called as it was (``parameters`` as a list: a generator
    is read once)."""
    why, args = _GRAD_UTILS[name]

    @functools.wraps(original)
    def guarded(parameters, *rest: Any, **kwargs: Any):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _copies:
            kinds = {_kind(p) for p in params}
            what = None
            if "model" in kinds:  # the model copies never get a gradient, inside a step or not
                what = "model copies (model.parameters() outside OptimizerCtx)"
            elif "optim" in kinds and not _inside_owners_steps(params):
                what = "parameters"
            if what is not None:
                raise RuntimeError(_GRAD_MESSAGE.format(name=name, what=what, why=why, args=args))
        return original(params, *rest, **kwargs)

    guarded.roundpipe_guard = True
    return guarded


def _install_clip_guard() -> None:
    """Puts :func:`_guarded_grad_util` in place of each of :data:`_GRAD_UTILS` under the names
    user code calls them by (``torch.nn.utils.<name>`` and, where torch defines it there,
    ``torch.nn.utils.clip_grad.<name>``, which torch's own ``clip_grad_norm`` alias calls);
    called once, with the step pre-hook."""
    from torch.nn.utils import clip_grad

    for name in _GRAD_UTILS:
        for module in (torch.nn.utils, clip_grad):
            original = getattr(module, name, None)
            if original is None or getattr(original, "roundpipe_guard", False):
                continue
            setattr(module, name, _guarded_grad_util(original, name))


def user_hooks(hooks: Iterable[Any]) -> list:
    """The hooks among ``hooks`` (an optimizer's or the global step hooks) that are not
    RoundPipe's own."""
    return [h for h in hooks if not (getattr(h, "roundpipe_guard", False)
                                     or getattr(h, "roundpipe_wait", False))]
