"""LoRA on a bfloat16, int8 and NF4 frozen base (issue 25 item 4): rows of
``python -m roundpipe.bench memory``.

One Llama-architecture model (``transformers.LlamaConfig``, built from its config in bfloat16,
no download) with PEFT LoRA adapters on every projection, trained through RoundPipe on the CPU
device with its frozen linears kept as ``frozen_dtype`` = None (bf16), ``"int8"``, ``"nf4"`` and
``"nf4-dq"`` (:mod:`roundpipe.quant`). Per base:

- **host B/param**: bytes the frozen linears' weights take on the host (codes plus block
  scales) over their parameter count (the issue's targets: bf16 <= 2.1, int8 <= 1.15, NF4 <=
  0.6); next to it the whole frozen base's (embeddings, norms and ``lm_head`` stay bfloat16);
- **upload vs bf16**: ``pipeline_stats()["h2d_weight_bytes"]`` of one training step over the
  bf16 base's;
- **tokens/s vs bf16**: training tokens per second (``forward_backward`` + ``step``), each
  round timing every base once in rotated order, the ratio per round: median (min-max).

And the dequantization itself: values per second of the SIMD kernel (``roundpipe._C``, what
:func:`roundpipe.quant.dequantize` runs on the CPU) against the torch ops (what it runs on
CUDA, :func:`roundpipe.quant.dequantize_torch`) on one weight, into bfloat16, one thread each,
interleaved rounds.
"""

from __future__ import annotations

import argparse

import torch

from . import Figure, interleave, paired_ratio, positive_int, timed

BASES = {"bf16": None, "int8": "int8", "nf4": "nf4", "nf4-dq": "nf4-dq"}
#: the issue's targets for host bytes per frozen-linear parameter
TARGETS = {"bf16": 2.1, "int8": 1.15, "nf4": 0.6, "nf4-dq": 0.6}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of these rows, on ``python -m roundpipe.bench memory``'s parser."""
    ap.add_argument("--skip-lora", action="store_true",
                    help="skip the LoRA rows (bf16 / int8 / NF4 frozen base)")
    ap.add_argument("--lora-hidden", type=positive_int, default=512,
                    help="hidden size of the LoRA rows' Llama model (default 512)")
    ap.add_argument("--lora-layers", type=positive_int, default=4)
    ap.add_argument("--lora-seq", type=positive_int, default=128,
                    help="tokens per sequence of a training batch (4 sequences)")
    ap.add_argument("--dequant-values", type=positive_int, default=16 * 1024 * 1024,
                    help="values of the weight the dequantization is timed on (default 16M)")


def _model(hidden: int, layers: int, frozen_dtype):
    import peft
    import transformers

    import roundpipe

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden,
                                   intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128),
                                   max_position_embeddings=4096)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    from roundpipe.quant import frozen_linears
    linears = [model.get_submodule(n) for n in frozen_linears(model, "nf4")]
    dense = sum(m.weight.numel() for m in linears)
    base_params = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=2,
                                          frozen_dtype=frozen_dtype)
    return w, model, dense, base_params


def _host_bytes(model, frozen_dtype, dense: int) -> tuple[float, float]:
    """(bytes per frozen-linear parameter, bytes of the whole frozen base per base parameter)."""
    from roundpipe.quant import host_bytes

    if frozen_dtype is None:
        linear_bytes = 2 * dense  # bfloat16 weights
    else:
        linear_bytes, values = host_bytes(model)
        assert values == dense
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}.values()
    return linear_bytes / dense, sum(p.numel() * p.element_size() for p in frozen)


def measure(args) -> dict:
    """The LoRA rows and the dequantization speed (see the module docstring)."""
    import roundpipe.optim as rpo

    batch = 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch, args.lora_seq), generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    runs, rows = {}, {}
    for name, fd in BASES.items():
        w, model, dense, base_params = _model(args.lora_hidden, args.lora_layers, fd)
        per_linear, base_bytes = _host_bytes(model, fd, dense)
        opt = rpo.AdamW(w.optim_parameters(), lr=1e-4)
        w.forward_backward(input_kwargs=inputs)  # warm-up
        w.step(opt)
        w.synchronize()
        w.pipeline_stats(reset=True)
        w.forward_backward(input_kwargs=inputs)
        w.step(opt)
        w.synchronize()
        uploads = w.pipeline_stats()["h2d_weight_bytes"]

        def step(w=w, opt=opt):
            w.forward_backward(input_kwargs=inputs)
            w.step(opt)
            w.synchronize()
        runs[name] = timed(step)
        rows[name] = dict(frozen_dtype=fd, linear_params=dense, host_bytes_per_param=per_linear,
                          base_bytes_per_param=base_bytes / base_params,
                          upload_bytes_per_step=uploads)
    seconds = interleave(runs, args.repeats)
    tokens = batch * args.lora_seq
    for name, row in rows.items():
        row["tokens_per_s"] = Figure.of([tokens / s for s in seconds[name]]).as_dict()
        row["tokens_vs_bf16"] = paired_ratio(seconds["bf16"], seconds[name]).as_dict()
        row["upload_vs_bf16"] = row["upload_bytes_per_step"] / rows["bf16"]["upload_bytes_per_step"]
    return {"model": dict(hidden=args.lora_hidden, layers=args.lora_layers, seq=args.lora_seq,
                          batch=batch), "rows": rows,
            "dequant": measure_dequant(args.dequant_values, args.repeats)}


def measure_dequant(n: int, repeats: int) -> dict:
    """Values per second of dequantizing ``n`` values into bfloat16, the SIMD kernel against the
    torch ops, NF4 and int8, interleaved rounds, on one thread each (the per-core speed: on a
    busy machine torch's OpenMP threads wait for each other); the kernel's speed-up per round."""
    from roundpipe import _C

    before = _C.num_threads(), torch.get_num_threads()
    _C.set_num_threads(1)
    torch.set_num_threads(1)
    try:
        return _dequant_rounds(n, repeats)
    finally:
        _C.set_num_threads(before[0])
        torch.set_num_threads(before[1])


def _dequant_rounds(n: int, repeats: int) -> dict:
    from roundpipe import _C
    from roundpipe.quant import dequantize, dequantize_torch, quantize

    w = torch.randn(n // 4096 or 1, min(n, 4096), dtype=torch.bfloat16)
    contenders, shapes = {}, {}
    for kind in ("nf4", "int8"):
        codes, scales = quantize(w, kind)
        contenders[f"{kind} kernel"] = timed(
            lambda c=codes, s=scales, k=kind: dequantize(c, s, k, w.shape, torch.bfloat16))
        contenders[f"{kind} torch"] = timed(
            lambda c=codes, s=scales, k=kind: dequantize_torch(c, s, k, w.shape, torch.bfloat16))
    for f in contenders.values():  # warm-up
        f()
    seconds = interleave(contenders, repeats)
    out = {"values": w.numel(), "kernel_threads": _C.num_threads(),
           "torch_threads": torch.get_num_threads(), "isa": _C.active_isa()}
    for kind in ("nf4", "int8"):
        for who in ("kernel", "torch"):
            out[f"{kind} {who} Gvalues/s"] = Figure.of(
                [w.numel() / s / 1e9 for s in seconds[f"{kind} {who}"]]).as_dict()
        out[f"{kind} speed-up"] = paired_ratio(seconds[f"{kind} torch"],
                                               seconds[f"{kind} kernel"]).as_dict()
    return out


def format_table(result: dict) -> str:
    """The LoRA rows and the dequantization speed as Markdown."""
    m = result["model"]
    lines = [f"\nLoRA (r=8, every projection) on a frozen base: Llama {m['layers']} x "
             f"{m['hidden']}, batch {m['batch']} x {m['seq']} tokens, CPU device, bfloat16 compute",
             "| base | host B/param (linears; target) | host B/param (whole base) "
             "| upload bytes/step vs bf16 | tokens/s | tokens/s vs bf16 |",
             "|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['host_bytes_per_param']:.3f} (<= {TARGETS[name]}) | "
            f"{r['base_bytes_per_param']:.3f} | {r['upload_vs_bf16']:.3f} | "
            f"{Figure.from_dict(r['tokens_per_s']).text(0)} | "
            f"{Figure.from_dict(r['tokens_vs_bf16']).text(2, 'x')} |")
    d = result["dequant"]
    lines.append(f"\ndequantization into bfloat16, {d['values']:,} values, ISA {d['isa']}, "
                 f"{d['kernel_threads']} thread (kernel) / {d['torch_threads']} (torch):")
    lines += ["| format | SIMD kernel Gvalues/s | torch ops Gvalues/s | kernel speed-up |",
              "|---|---|---|---|"]
    for kind in ("nf4", "int8"):
        lines.append(f"| {kind} | {Figure.from_dict(d[f'{kind} kernel Gvalues/s']).text(2)} | "
                     f"{Figure.from_dict(d[f'{kind} torch Gvalues/s']).text(2)} | "
                     f"{Figure.from_dict(d[f'{kind} speed-up']).text(1, 'x')} |")
    lines.append("medians (min-max) over interleaved rounds; ratios per round")
    return "\n".join(lines)
