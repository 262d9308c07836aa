"""Warnings that other libraries print on a normal RoundPipe run although nothing is wrong with
the user's code, filtered where they come from, narrowly: by message, category and the module
the warning is attributed to (the library's own file that warns), so nothing else is hidden.
:func:`install` runs on ``import roundpipe``.

Each entry says who prints it and why it is not the user's business:

- peft (0.17-0.21) reads ``model.is_gradient_checkpointing`` in ``PeftModel.__init__``; in
  transformers 5 that property is a deprecated alias and ``transformers.modeling_utils`` warns
  (``FutureWarning``, attributed to itself) on every ``get_peft_model``: peft's use of
  transformers, not the user's (a user's own read of the alias is silenced with it);
- torch's ``DataLoader`` on a machine without a GPU warns that ``pin_memory=True`` has no
  accelerator to pin for: ``transformers.Trainer`` (and so ``RoundPipeTrainer``) passes its
  default ``dataloader_pin_memory=True`` on every machine; the batches stay in ordinary host
  memory, as the CPU needs them.

(``torch.distributed.checkpoint``'s single-process and overwrite notices are filtered around
RoundPipe's own calls in :mod:`roundpipe.checkpoint`, the one place they come from.)
"""

from __future__ import annotations

import warnings

#: (message regex, category, module regex) of each filtered warning
FILTERS = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils$"),
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
     r"torch\.utils\.data\.dataloader$"),
)


def install() -> None:
    """Adds an "ignore" filter for each of :data:`FILTERS` (idempotent: ``warnings`` drops a
    filter equal to one already there)."""
    for message, category, module in FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
