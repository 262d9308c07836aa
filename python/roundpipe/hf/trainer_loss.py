"""A trainer's own loss through the pipeline: a ``compute_loss`` override or ``compute_loss_func``.

Plain ``transformers.Trainer`` computes the loss as ``compute_loss(model, inputs,
num_items_in_batch=...)``: ``model(**inputs)`` gives the logits, and a subclass's override (or
``Trainer(compute_loss_func=...)``, which ``Trainer.compute_loss`` calls) turns them into the
loss, whose ``backward()`` Trainer then calls. Under RoundPipe the logits exist one microbatch
at a time, inside the pipeline's last stage, so :class:`RoundPipeTrainer` calls
``compute_loss`` once per microbatch from ``forward_backward``'s ``loss_fn``:

- ``model`` is a :class:`LogitsModel`: called with the microbatch's inputs, it returns what the
  Hugging Face model would (``CausalLMOutputWithPast``: the logits the pipeline computed, and
  with ``labels`` HF's loss of them, with ``num_items_in_batch`` when given);
- ``inputs`` are the microbatch's rows of the batch (every key the collator gave, ``labels``
  and extra columns included), ``num_items_in_batch`` is Trainer's count for the whole
  accumulation window (as plain Trainer passes it);
- the microbatches' losses are combined as Trainer's convention says
  (``Trainer.loss_is_scaled_for_ga``, or by default whether ``num_items_in_batch`` reached the
  loss): a loss already scaled for the window (a sum over tokens divided by
  ``num_items_in_batch``) is summed over the microbatches; a per-batch mean is weighted by
  each microbatch's rows (``loss_reduction="mean"``, exact for a mean over rows) and divided by
  the number of accumulation steps, as Trainer divides it;
- with ranks whose gradients RoundPipe sums (``average_tokens_across_devices``), each rank's
  loss is divided by the number of ranks before its backward, so the gradient is the mean of
  the ranks' as DDP's (what plain Trainer's backward gives).

Evaluation calls ``compute_loss(model, inputs, return_outputs=True, ...)`` once per batch with
the whole batch's logits (on the host), as plain Trainer's ``prediction_step`` does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# the keyword arguments of the HF model's forward that the pipeline takes
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
_IGNORED = ("use_cache", "return_dict", "output_attentions", "output_hidden_states")


def loss_override(trainer: Any, builtin: tuple) -> Optional[str]:
    """What makes ``trainer``'s loss its own: ``"compute_loss"`` when its class (or a class
    between it and ``transformers.Trainer``) overrides ``compute_loss`` in a class not in
    ``builtin`` (the trainer classes whose loss RoundPipe computes itself, e.g.
    ``transformers.Trainer``, TRL's ``SFTTrainer``), ``"compute_loss_func"`` when one was
    given, else None."""
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)
    if owner not in builtin:
        return "compute_loss"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "compute_loss_func"
    return None


def is_scaled_for_ga(trainer: Any, num_items_in_batch: Any) -> bool:
    """Whether ``compute_loss``'s loss is already scaled for the accumulation window: Trainer's
    own rule (``training_step``)."""
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return bool(trainer.loss_is_scaled_for_ga)
    return bool((trainer.model_accepts_loss_kwargs and num_items_in_batch is not None)
                or trainer.compute_loss_func is not None)


class LogitsModel:
    """The ``model`` a trainer's ``compute_loss`` receives under RoundPipe: called with a batch's
    (or microbatch's) inputs, it returns the Hugging Face model's output for them, whose logits
    the pipeline already computed.

    Args:
        wrapper: the :class:`roundpipe.hf.HFRoundPipe` (attributes such as ``config`` are read
            through it).
        inputs: the model inputs the logits belong to (``input_ids``, ``attention_mask``,
            ``position_ids``, ``inputs_embeds``, those present).
        logits: ``(b, S, V)``, the model dtype, on the device the loss runs on (the compute
            device in training, the host in evaluation); part of the autograd graph in
            training.

    Raises (when called):
        ValueError: the call's model inputs are not those of the batch the logits belong to
            (another tensor, or a key added or left out): the pipeline computed the logits of
            the batch's own inputs.
        TypeError: an argument the HF model's forward would take that RoundPipe cannot honour
            (e.g. ``output_hidden_states=True``), or an unknown one.
    """

    def __init__(self, wrapper: Any, inputs: dict, logits: torch.Tensor) -> None:
        self._wrapper, self._inputs, self._logits = wrapper, inputs, logits

    def __call__(self, input_ids: Optional[torch.Tensor] = None, attention_mask=None, *,
                 labels: Optional[torch.Tensor] = None, num_items_in_batch: Any = None,
                 **kwargs: Any):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        for key in _IGNORED:
            if kwargs.get(key):
                if key in ("use_cache", "return_dict"):
                    kwargs.pop(key)
                    continue
                raise TypeError(f"RoundPipeTrainer: compute_loss called the model with "
                                f"{key}=True, which RoundPipe's pipeline does not return")
            kwargs.pop(key, None)
        unknown = sorted(k for k in kwargs if k not in MODEL_KEYS)
        if unknown:
            raise TypeError(f"RoundPipeTrainer: compute_loss called the model with "
                            f"{', '.join(unknown)}, which it does not take (it takes "
                            f"{', '.join(MODEL_KEYS)}, labels, num_items_in_batch)")
        given = {k: v for k, v in dict(kwargs, input_ids=input_ids,
                                       attention_mask=attention_mask).items() if v is not None}
        if set(given) != set(self._inputs) or any(
                v is not self._inputs[k] and not _equal(v, self._inputs[k])
                for k, v in given.items()):
            raise ValueError(
                "RoundPipeTrainer: compute_loss called the model with other inputs than the "
                f"batch's (given: {sorted(given)}, the batch's: {sorted(self._inputs)}); "
                "RoundPipe computes the logits of the batch's own inputs in its pipeline: call "
                "model(**inputs) with the inputs compute_loss received (labels and extra "
                "columns may be removed)")
        loss = None
        if labels is not None:
            hf = self._wrapper.hf_model
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            loss = hf.loss_function(self._logits, labels.to(self._logits.device),
                                    vocab_size=hf.config.vocab_size, **extra)
        return CausalLMOutputWithPast(loss=loss, logits=self._logits)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._wrapper, name)


def _equal(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and torch.equal(a.to(b.device), b))


def model_inputs(batch: dict) -> dict:
    """The entries of ``batch`` the pipeline takes as the model's inputs."""
    return {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}


def training_loss(trainer: Any, wrapper: Any, batch: dict, num_items_in_batch: Any,
                  ranks: int, **step_kwargs: Any) -> torch.Tensor:
    """One batch of the accumulation window through ``forward_backward`` with the trainer's
    ``compute_loss`` called per microbatch (see the module docstring). ``ranks``: the number
    of ranks whose gradients RoundPipe sums (1 otherwise). Returns the loss Trainer's
    ``training_step`` would return (detached, on the host)."""
    scaled = is_scaled_for_ga(trainer, num_items_in_batch)
    factor = (1.0 if scaled else 1.0 / trainer.current_gradient_accumulation_steps) / ranks
    inputs = model_inputs(batch)

    def loss_fn(logits: torch.Tensor, mb: dict) -> torch.Tensor:
        model = LogitsModel(wrapper, model_inputs(mb), logits)
        loss = trainer.compute_loss(model, dict(mb), num_items_in_batch=num_items_in_batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("RoundPipeTrainer: compute_loss must return a 1-element tensor "
                            f"(with return_outputs=False), got {type(loss).__name__}")
        return loss.reshape(()) * factor

    loss = wrapper.forward_backward(input_kwargs=inputs, label=dict(batch), loss_fn=loss_fn,
                                    loss_reduction="sum" if scaled else "mean", **step_kwargs)
    return loss * ranks


def evaluation_loss(trainer: Any, wrapper: Any, batch: dict, num_items_in_batch: Any):
    """``compute_loss(model, batch, return_outputs=True, num_items_in_batch=...)`` on the whole
    batch's logits (computed without autograd, on the host): ``(loss, logits)``."""
    inputs = model_inputs(batch)
    with torch.no_grad():
        logits = wrapper(**inputs).logits
        loss, outputs = trainer.compute_loss(LogitsModel(wrapper, inputs, logits), dict(batch),
                                             return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
    out_logits = outputs.get("logits") if isinstance(outputs, dict) else outputs[1]
    return loss.detach().mean(), out_logits
