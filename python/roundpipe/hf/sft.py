"""``RoundPipeSFTTrainer``: TRL's ``SFTTrainer`` driving RoundPipe (needs trl).

Everything of :class:`roundpipe.hf.trainer.RoundPipeTrainerMixin`, plus TRL's parts: its
datasets (plain text, prompt/completion, chat ``messages`` through the tokenizer's template),
``completion_only_loss`` / ``assistant_only_loss`` (TRL's collator sets the labels of the
tokens not scored to -100, which the pipeline's loss ignores), ``peft_config=`` (TRL applies it,
then the trainer wraps the ``PeftModel``), its metrics ``num_tokens``, ``mean_token_accuracy``
and ``entropy`` (the last two counted by the chunked loss from the logits it computes anyway,
see :mod:`roundpipe.hf.loss`; in training and evaluation, as TRL logs them), ``packing`` and
``padding_free`` (one packed row per batch, cut into microbatches at sequence starts, see
:mod:`roundpipe.hf.packed`; attention stays within each sequence through ``position_ids``).

SFTConfig defaults that conflict with RoundPipe: ``gradient_checkpointing=True`` is switched
off with a warning (RoundPipe recomputes already); ``bf16=True`` (SFTConfig's default) makes
the model copy bf16 with fp32 optimizer copies, without autocast; ``loss_type="dft"`` is
refused with a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - exercised by a test with trl hidden
    raise ImportError("roundpipe.hf.RoundPipeSFTTrainer needs TRL: pip install trl "
                      "(tested with trl 1.16; or pip install 'roundpipe[trainer]')") from e

from transformers import Trainer

from .trainer import RoundPipeTrainerMixin, _WrapModel


class RoundPipeSFTTrainer(RoundPipeTrainerMixin, SFTTrainer, _WrapModel):
    """``trl.SFTTrainer`` training through RoundPipe; constructed as ``SFTTrainer`` is, plus
    ``roundpipe_kwargs`` (see :class:`roundpipe.hf.RoundPipeTrainer` and the module docstring)::

        trainer = RoundPipeSFTTrainer(model=hf_model, args=SFTConfig(...),
                                      train_dataset=chat_dataset, processing_class=tokenizer,
                                      peft_config=peft.LoraConfig(...),
                                      roundpipe_kwargs={"num_microbatch": 2})

    Raises:
        ValueError: ``loss_type`` other than ``"nll"``, and everything
            :class:`roundpipe.hf.RoundPipeTrainer` refuses.
    """

    _rp_builtin_loss = (Trainer, SFTTrainer)  # TRL's compute_loss: its metrics, see above

    def __init__(self, *pos: Any, **kwargs: Any) -> None:
        args = kwargs.get("args", pos[1] if len(pos) > 1 else None)
        if args is not None:
            if getattr(args, "loss_type", "nll") != "nll":
                raise ValueError(f"RoundPipeSFTTrainer: loss_type={args.loss_type!r} is not "
                                 "supported; the pipeline computes the token-mean NLL ('nll')")
        super().__init__(*pos, **kwargs)

    def training_step(self, model, inputs: dict, num_items_in_batch=None):
        """RoundPipe's training step plus TRL's ``num_tokens``, ``mean_token_accuracy`` and
        ``entropy``."""
        self._count_tokens(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._log_token_stats("train", self.model.last_token_stats())
        return loss

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        """RoundPipe's evaluation step; ``num_tokens``, ``mean_token_accuracy`` and ``entropy``
        as TRL logs them in evaluation."""
        self._metrics["eval"]["num_tokens"] = [self._total_train_tokens]
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _rp_eval_stats(self, stats) -> None:
        self._log_token_stats("eval", stats)

    def _log_token_stats(self, mode: str, stats) -> None:
        """TRL's ``entropy`` and ``mean_token_accuracy`` of a batch (``SFTTrainer.compute_loss``:
        sums over every rank's scored tokens, divided by their count; 0 without one)."""
        device = self.args.device
        n, hits, entropy = (self.accelerator.gather_for_metrics(torch.tensor(v, device=device))
                            .sum() for v in (stats.tokens, stats.top1, stats.entropy))
        self._metrics[mode]["entropy"].append((entropy / n).item() if n > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((hits / n).item() if n > 0 else 0.0)

    def _count_tokens(self, inputs: dict) -> None:
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        else:
            local = inputs["input_ids"].new_tensor(inputs["input_ids"].numel())
        total = self.accelerator.gather_for_metrics(local.to(self.args.device)).sum().item()
        self._total_train_tokens += total // self._tp_size
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]


__all__ = ["RoundPipeSFTTrainer"]
