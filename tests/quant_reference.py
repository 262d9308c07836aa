"""The float64 references of the quantized-base tests (tests/test_quantized.py,
tests/test_loading.py), written from the published formats and independent of roundpipe.quant:
QLoRA's NF4 code book (Dettmers et al. 2023; bitsandbytes' ``get_4bit_type("nf4")``), blocks of
64 values with one absmax each, the nearest code by argmin over distances (not midpoints), and
blockwise int8 (absmax / 127 per block, round half to even); plus the tiny causal-LM batch
both files train on."""

from __future__ import annotations

import torch

# QLoRA's NF4 data type, as published (bitsandbytes functional.py, get_4bit_type("nf4")).
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def reference_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = w.detach().double().reshape(-1)
    pad = (-x.numel()) % 64
    x = torch.cat([x, x.new_zeros(pad)]).view(-1, 64)
    return x, x.abs().amax(dim=1)


def reference_nf4(w: torch.Tensor):
    x, absmax = reference_blocks(w)
    code = torch.tensor(PUBLISHED_NF4, dtype=torch.float64)
    scaled = x / torch.where(absmax > 0, absmax, 1.0)[:, None]
    idx = (scaled[..., None] - code).abs().argmin(dim=-1).reshape(-1)  # first of equals
    packed = (idx[0::2] * 16 + idx[1::2]).to(torch.uint8)
    values = (code[idx].view(-1, 64) * absmax[:, None]).float().reshape(-1)[:w.numel()]
    return packed, absmax.float(), values.view(w.shape)


def reference_int8(w: torch.Tensor):
    x, absmax = reference_blocks(w)
    q = torch.round(x * 127 / torch.where(absmax > 0, absmax, 1.0)[:, None]).clamp(-127, 127)
    scale = (absmax / 127).float()
    values = (q * scale.double()[:, None]).float().reshape(-1)[:w.numel()]
    return q.reshape(-1).to(torch.int8), scale, values.view(w.shape)


def make_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
