"""What the GPU scripts of scripts/gpu_check.sh share: the 1.82B Llama they train (or, with
SMOKE=1, a tiny one on the CPU, to dry-run the scripts without a GPU), its batches, and the
JSON result file under $OUT."""

from __future__ import annotations

import json
import os
import time

import torch

SMOKE = os.environ.get("SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda:0"
OUT = os.environ.get("OUT", "/tmp/gpu_check")


def llama_config(layers: int = 24, hidden: int = 2560, intermediate: int = 6912, heads: int = 20,
                 kv_heads: int = 4, vocab: int = 32000):
    """The 1.82B Llama's geometry (24 x 2560, MLP 6912, 20 heads, 4 KV heads, 32k vocabulary);
    with SMOKE=1 a tiny one."""
    from transformers import LlamaConfig

    if SMOKE:
        return LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=min(layers, 4), num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=2048)


def build(cfg, dtype=torch.bfloat16):
    """The model, its weights drawn on the GPU (seconds; minutes on the host), on the host."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    start = time.time()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.cpu()
    empty_cache()
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n / 1e9:.3f}B parameters, built in {time.time() - start:.1f} s", flush=True)
    return model


def batch(cfg, rows: int, seq: int, seed: int = 1) -> torch.Tensor:
    if SMOKE:
        seq = min(seq, 64)
    return torch.randint(0, cfg.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))


def train_step(model, opt, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """One training step of an HF model wrapped by RoundPipe on the token batch ``ids`` (its own
    labels) in ``mode``: "exact" (the step inside forward_backward), "sync" or "async"
    (``model.step(opt, is_async=...)`` after it). Returns the loss."""
    kw = {"input_kwargs": {"input_ids": ids, "labels": ids}}
    if mode == "exact":
        return model.forward_backward(**kw, optimizer=opt)
    loss = model.forward_backward(**kw)
    model.step(opt, is_async=mode == "async")
    return loss


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def empty_cache() -> None:
    if not SMOKE:
        torch.cuda.empty_cache()


def peak_gib() -> float:
    return 0.0 if SMOKE else torch.cuda.max_memory_allocated(torch.device(DEVICE)) / 2**30


def allocated_gib() -> float:
    """Device memory allocated now (GiB)."""
    return 0.0 if SMOKE else torch.cuda.memory_allocated(torch.device(DEVICE)) / 2**30


def reset_peak() -> None:
    if not SMOKE:
        torch.cuda.reset_peak_memory_stats(torch.device(DEVICE))
        torch.cuda.reset_accumulated_memory_stats(torch.device(DEVICE))  # counts, e.g. retries


def save(name: str, result: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(result, f, indent=1)
