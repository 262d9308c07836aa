"""What the pipeline tests train, and the plain PyTorch loop they compare RoundPipe against:

- model builders: small ``nn.Sequential`` models (``mlp``, ``transformer`` with dropout,
  ``batchnorm``, ``tanh_net``) and tiny Hugging Face causal LMs built from a config
  (``causal_lm``: no hub);
- data (``data``) and the loss written as for plain PyTorch (``loss_fn``);
- ``small_device(nbytes)``: a device of ``nbytes`` for a wrapper made inside it (an int
  ``memory_budget`` under 1 MiB is refused, so tiny models are planned under
  ``memory_budget=1.0`` of a device that small);
- the reference: ``reference_forward_backward`` (microbatches with gradient accumulation, each
  layer seeded as RoundPipe documents) and ``assert_params_equal``.

Tests import it by name (pytest puts tests/ on ``sys.path``; child interpreters get it through
``launcher.child_env``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from torch import nn

from roundpipe import layer_seed

@contextlib.contextmanager
def small_device(nbytes: int):
    """While the block runs, every device has ``nbytes`` of memory for the wrappers made in it
    (their budget is taken at construction): ``memory_budget=1.0`` is then ``nbytes``."""
    import roundpipe.staging

    with mock.patch.object(roundpipe.staging, "device_memory", lambda devices: nbytes):
        yield


# --- small sequential models ----------------------------------------------------------------


def mlp():
    """Linear 8 -> 32, ReLU, Linear 32 -> 32, Tanh, Linear 32 -> 4 (float32, torch's init)."""
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def transformer():
    """Linear 8 -> 16, two ``TransformerEncoderLayer`` (dropout 0.1), Dropout, Linear 16 -> 4:
    inputs ``(batch, 5, 8)``; the dropout tests that the recomputation replays the randomness."""
    layer = lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1,  # noqa: E731
                                               batch_first=True)
    return nn.Sequential(nn.Linear(8, 16), layer(), layer(), nn.Dropout(0.1), nn.Linear(16, 4))


def batchnorm():
    """Linear 8 -> 16, BatchNorm1d, ReLU, Linear 16 -> 4: buffers that training changes."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


MODELS = {"mlp": mlp, "transformer": transformer, "batchnorm": batchnorm}


def tanh_net(dtype=torch.float32, seed: int = 0) -> nn.Module:
    """Linear 6 -> 16, Tanh, Linear 16 -> 3 in ``dtype``, its weights drawn after
    ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def data(name, step, batch=6):
    """The batch of ``step`` for model ``name`` of ``MODELS``: inputs ``(batch, 8)`` (the
    transformer's ``(batch, 5, 8)``) and float32 targets with 4 features, from a generator
    seeded by the step."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (batch, 5, 8) if name == "transformer" else (batch, 8)
    x = torch.randn(shape, generator=g)
    y = torch.randn(shape[:-1] + (4,), generator=g)
    return x, y


def loss_fn(out, target):
    """Written as for plain PyTorch: the mean over the microbatch's rows (of each row's summed
    squared error); RoundPipe weights it by the microbatch's share of the batch."""
    return ((out.float() - target.float()) ** 2).flatten(1).sum(1).mean()


# --- the reference: a plain PyTorch loop ------------------------------------------------------

def reference_forward_backward(net, x, y, num_microbatch, call_seed, after_microbatch=None):
    """Plain loop: each microbatch forward (every layer seeded as RoundPipe documents) and
    backward, gradients accumulated by autograd into .grad (or handed to after_microbatch)."""
    total = 0.0
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, num_microbatch),
                                     torch.tensor_split(y, num_microbatch))):
        h = xm
        for i, layer in enumerate(net):
            with torch.random.fork_rng():
                torch.manual_seed(layer_seed(call_seed, i, m))
                h = layer(h)
        loss = loss_fn(h, ym) * (len(xm) / len(x))  # gradient accumulation of a batch mean
        loss.backward()
        total += loss.item()
        if after_microbatch:
            after_microbatch()
    return total


def assert_params_equal(model, ref, rtol=1e-5, atol=1e-6):
    """The wrapper's optimizer copies equal ``ref``'s parameters, name by name."""
    for (name, p), (rname, r) in zip(model.optim_named_parameters(), ref.named_parameters()):
        assert name == rname
        torch.testing.assert_close(p.detach(), r.detach(), rtol=rtol, atol=atol, msg=name)


# --- tiny Hugging Face causal LMs -------------------------------------------------------------

HF_VOCAB = 101
HF_COMMON = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 attention_dropout=0.0)


def causal_lm(kind: str, seed: int = 0, **config) -> nn.Module:
    """A tiny float32 transformers causal LM of family ``kind``, its weights drawn after
    ``torch.manual_seed(seed)``: ``HF_COMMON`` sizes (2 layers 32 wide, vocabulary 101)
    updated by ``config``. Skips the test when transformers is not installed; ``ValueError``
    for an unknown kind.

    Kinds: ``llama``, ``qwen2``, ``qwen3`` and ``qwen3_tied`` (tied embeddings),
    ``qwen3_moe`` (4 experts, top 2, router auxiliary loss), ``mistral_sliding`` (window 4),
    ``doge``, ``gemma3`` (a rotary embedding per layer type), ``olmo3``, ``mellum``,
    ``mimo_v2_flash`` (dense layers) and ``mimo_v2_flash_moe`` (its default sparse layer).
    """
    transformers = pytest.importorskip("transformers")
    c = {**HF_COMMON, **config}
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**c))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**c))
    elif kind in ("qwen3", "qwen3_tied"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **c, head_dim=8, tie_word_embeddings=kind == "qwen3_tied"))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **c, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.3))
    elif kind == "mistral_sliding":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**c, sliding_window=4))
    elif kind == "doge":
        model = transformers.DogeForCausalLM(transformers.DogeConfig(**c))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **c, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"]))
    elif kind == "olmo3":
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **c, sliding_window=4, eos_token_id=1, pad_token_id=0))
    elif kind == "mellum":
        model = transformers.MellumForCausalLM(transformers.MellumConfig(**c, head_dim=8))
    elif kind in ("mimo_v2_flash", "mimo_v2_flash_moe"):
        layers = ["dense", "dense"] if kind == "mimo_v2_flash" else None
        model = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(
            **c, head_dim=8, mlp_layer_types=layers))
    else:
        raise ValueError(kind)
    return model.float()
