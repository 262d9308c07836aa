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
    ap.add_argument("--lora-hidden", type=positive_int, default=256,
                    help="hidden size of the LoRA rows' Llama model (default 256)")
    ap.add_argument("--lora-layers", type=positive_int, default=2)
    ap.add_argument("--lora-seq", type=positive_int, default=64,
                    help="tokens per sequence of a training batch (4 sequences; default 64)")
    ap.add_argument("--dequant-values", type=positive_int, default=16 * 1024 * 1024,
                    help="values of the weight the dequantization is timed on (default 16M)")


def _model(hidden: int, layers: int, frozen_dtype, device: str):
    import peft
    import transformers

    import roundpipe
    from roundpipe.quant import frozen_linears

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden,
                                   intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
                                   num_hidden_layers=layers,
                                   num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128),
                                   max_position_embeddings=4096)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    linears = [model.get_submodule(n) for n in frozen_linears(model, "nf4")]
    dense = sum(m.weight.numel() for m in linears)
    base_params = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device=device, num_microbatch=2,
                                          frozen_dtype=frozen_dtype)
    return w, model, dense, base_params


def _host_bytes(model, frozen_dtype, dense: int) -> tuple[float, float]:
    """(bytes per frozen-linear parameter, bytes of the whole frozen base)."""
    from roundpipe.quant import host_bytes

    if frozen_dtype is None:
        linear_bytes = 2 * dense  # bfloat16 weights
    else:
        linear_bytes, values = host_bytes(model)
        assert values == dense
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}.values()
    return linear_bytes / dense, sum(p.numel() * p.element_size() for p in frozen)


def measure(args) -> dict:
    """The LoRA rows on the CPU device and the dequantization speed (module docstring)."""
    out = measure_training(args.lora_hidden, args.lora_layers, args.lora_seq, args.repeats,
                           "cpu", list(BASES))
    out["dequant"] = measure_dequant(args.dequant_values, args.repeats)
    return out


def measure_training(hidden: int, layers: int, seq: int, repeats: int, device: str,
                     bases: list[str], batch: int = 4) -> dict:
    """LoRA training on each base of ``bases`` (keys of :data:`BASES`, "bf16" first) on
    ``device`` with ``batch`` sequences of ``seq`` tokens: host bytes, upload bytes of one step
    and their floor (``weight_floor_bytes``: every stage's packed weights once per visit),
    tokens/s (interleaved rounds, one step each) and their ratios to the bf16 base's."""
    import roundpipe.optim as rpo

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch, seq), generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    runs, rows = {}, {}
    for name in bases:
        fd = BASES[name]
        w, model, dense, base_params = _model(hidden, layers, fd, device)
        per_linear, base_bytes = _host_bytes(model, fd, dense)
        opt = rpo.AdamW(w.optim_parameters(), lr=1e-4)

        def step(w=w, opt=opt):
            w.forward_backward(input_kwargs=inputs)
            w.step(opt)
            w.synchronize()
            sync()
        step()  # warm-up
        w.pipeline_stats(reset=True)
        step()
        stats = w.pipeline_stats()
        runs[name] = timed(step)
        rows[name] = dict(frozen_dtype=fd, linear_params=dense, host_bytes_per_param=per_linear,
                          base_bytes_per_param=base_bytes / base_params,
                          upload_bytes_per_step=stats["h2d_weight_bytes"],
                          weight_floor_bytes_per_step=stats["weight_floor_bytes"])
    seconds = interleave(runs, repeats)
    tokens = batch * seq
    for name, row in rows.items():
        row["tokens_per_s"] = Figure.of([tokens / s for s in seconds[name]]).as_dict()
        row["tokens_vs_bf16"] = paired_ratio(seconds["bf16"], seconds[name]).as_dict()
        row["upload_vs_bf16"] = row["upload_bytes_per_step"] / rows["bf16"]["upload_bytes_per_step"]
        row["upload_vs_floor"] = row["upload_bytes_per_step"] / row["weight_floor_bytes_per_step"]
        row["step_s"] = Figure.of(seconds[name]).as_dict()
    return {"model": dict(hidden=hidden, layers=layers, seq=seq, batch=batch, device=device),
            "rows": rows}


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
             f"{m['hidden']}, batch {m['batch']} x {m['seq']} tokens, device {m['device']}, "
             "bfloat16 compute",
             "| base | host B/param (linears; target) | host B/param (whole base) "
             "| upload bytes/step vs bf16 | tokens/s | tokens/s vs bf16 |",
             "|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r['host_bytes_per_param']:.3f} (<= {TARGETS[name]}) | "
            f"{r['base_bytes_per_param']:.3f} | {r['upload_vs_bf16']:.3f} | "
            f"{Figure.from_dict(r['tokens_per_s']).text(0)} | "
            f"{Figure.from_dict(r['tokens_vs_bf16']).text(2, 'x')} |")
    d = result.get("dequant")
    if d is None:
        return "\n".join(lines)
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


def measure_cuda_layer(hidden: int, intermediate: int, repeats: int, device: str,
                       formats: tuple = ("nf4", "nf4-dq", "int8")) -> dict:
    """One Llama decoder layer's frozen linears on a CUDA ``device``: per interleaved round,
    the milliseconds (CUDA events) of uploading its NF4 codes and absmax from pinned host
    memory, of uploading its bfloat16 weights the same way (what a bf16 base moves), of
    dequantizing the NF4 weights on the device into bfloat16 with torch ops
    (:func:`roundpipe.quant.dequantize_torch`, the fallback) and with the fused kernel of each
    of ``formats`` (:func:`roundpipe.quant.dequantize` as RoundPipe calls it, one call per
    weight: :mod:`roundpipe.fused_dequant`; where it is refused, the reason, and the figure is
    the fallback's) and, where bitsandbytes is installed with CUDA, of its ``dequantize_4bit``
    of the same weights (which must give our bits). The fused kernels' output is compared with
    the torch ops' bit for bit."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from roundpipe import fused_dequant
    from roundpipe.quant import (_TABLES, _torch_ops, dequantize, dequantize_torch,
                                 expand_absmax, quantize)

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                                   num_attention_heads=max(1, hidden // 128),
                                   num_key_value_heads=max(1, hidden // 128))
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    weights = [m.weight.detach() for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    packed = [tuple(t.pin_memory() for t in quantize(w, "nf4")) for w in weights]
    dense = [w.pin_memory() for w in weights]
    on_device = [tuple(t.to(device) for t in p) for p in packed]
    try:
        import bitsandbytes.functional as bnb
        theirs = [bnb.quantize_4bit(w.to(device), blocksize=64, quant_type="nf4")
                  for w in weights]
    except Exception as e:  # not installed, or without CUDA
        print(f"bitsandbytes' CUDA dequantize_4bit not timed: {type(e).__name__}: {e}")
        theirs = None

    def events(fn):
        def run() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return run

    def upload(tensors):
        for t in tensors:
            t.to(device, non_blocking=True)
    contenders = {
        "upload nf4": events(lambda: [upload(p) for p in packed]),
        "upload bf16": events(lambda: upload(dense)),
        "dequant torch": events(lambda: [dequantize_torch(c, s, "nf4", w.shape, torch.bfloat16)
                                         for (c, s), w in zip(on_device, weights)]),
    }
    fused, refused, same_bits = {}, {}, {}
    for kind in formats:
        if fused_dequant.kernel(kind, torch.bfloat16, torch.device(device), _TABLES,
                                _torch_ops) is None:
            refused[kind] = fused_dequant.why_not(kind, torch.bfloat16, torch.device(device))
        fused[kind] = [tuple(t.to(device) for t in quantize(w, kind)) for w in weights]
        contenders[f"dequant fused {kind}"] = events(
            lambda q=fused[kind], k=kind: [dequantize(c, s, k, w.shape, torch.bfloat16)
                                           for (c, s), w in zip(q, weights)])
        same = True
        for (c, s), w in zip(fused[kind], weights):
            scales = expand_absmax(s, -(-w.numel() // 64)) if kind == "nf4-dq" else s
            want = dequantize_torch(c, scales, kind, w.shape, torch.bfloat16)
            same &= torch.equal(dequantize(c, s, kind, w.shape, torch.bfloat16).view(torch.int16),
                                want.view(torch.int16))
        same_bits[kind] = bool(same)
    if theirs is not None:
        contenders["dequant bitsandbytes"] = events(
            lambda: [bnb.dequantize_4bit(q, st) for q, st in theirs])
    for f in contenders.values():  # warm-up (kernels, caching allocator)
        f()
    ms = interleave(contenders, repeats)
    out = {"hidden": hidden, "intermediate": intermediate, "values": sum(w.numel() for w in weights),
           "packed_bytes": sum(t.numel() * t.element_size() for p in packed for t in p),
           "ms": {k: Figure.of(v).as_dict() for k, v in ms.items()},
           "dequant_over_upload": paired_ratio(ms["dequant torch"], ms["upload nf4"]).as_dict(),
           "fused_same_bits": same_bits, "fused_refused": refused,
           "fused_over_torch": {k: paired_ratio(ms[f"dequant fused {k}"],
                                                ms["dequant torch"]).as_dict() for k in formats}}
    if theirs is not None:
        same = all(torch.equal(dequantize_torch(q.reshape(-1), st.absmax.float(), "nf4",
                                                w.shape, torch.bfloat16),
                               bnb.dequantize_4bit(q, st))
                   for (q, st), w in zip(theirs, weights))
        out["equals_bitsandbytes"] = same
        out["torch_over_bitsandbytes"] = paired_ratio(ms["dequant torch"],
                                                      ms["dequant bitsandbytes"]).as_dict()
    return out


def format_cuda_layer(d: dict) -> str:
    """:func:`measure_cuda_layer`'s figures as Markdown."""
    lines = [f"\nNF4 on CUDA, one Llama layer ({d['hidden']} x {d['intermediate']}, "
             f"{d['values']:,} weight values, {d['packed_bytes']:,} packed bytes): ms per layer",
             "| upload NF4 | upload bf16 | dequantize (torch ops) | dequantize (bitsandbytes) "
             "| dequantize / NF4 upload |", "|---|---|---|---|---|"]
    ms = {k: Figure.from_dict(v).text(3) for k, v in d["ms"].items()}
    lines.append(f"| {ms['upload nf4']} | {ms['upload bf16']} | {ms['dequant torch']} | "
                 f"{ms.get('dequant bitsandbytes', '-')} | "
                 f"{Figure.from_dict(d['dequant_over_upload']).text(2, 'x')} |")
    for kind, same in d.get("fused_same_bits", {}).items():
        why = d["fused_refused"].get(kind)
        lines.append(f"fused kernel, {kind} into bf16: "
                     f"{Figure.from_dict(d['ms'][f'dequant fused {kind}']).text(3)} ms per layer "
                     f"(target <= 0.3 for nf4), "
                     f"{Figure.from_dict(d['fused_over_torch'][kind]).text(3, 'x')} the torch "
                     f"ops' nf4 time; same bits as the torch ops: {same}"
                     + (f"; REFUSED, torch ops used: {why}" if why else ""))
    if "equals_bitsandbytes" in d:
        lines.append(f"torch ops vs bitsandbytes: "
                     f"{Figure.from_dict(d['torch_over_bitsandbytes']).text(2, 'x')} the time; "
                     f"same bits: {d['equals_bitsandbytes']}")
    return "\n".join(lines)


#: the configurations ``python -m roundpipe.bench qlora`` trains by default: batch x tokens
CONFIGS = ("1x512", "4x512")


def config_arg(text: str) -> tuple[int, int]:
    """argparse type: ``BATCHxSEQ`` (e.g. ``1x512``)."""
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ such as 1x512, got {text!r}") \
            from None
    if batch < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ with both >= 1, got {text!r}")
    return batch, seq


def format_configs(result: dict) -> str:
    """Each configuration's bases side by side: tokens/s against the bf16 base's, upload bytes
    per step against their packed floor and against the bf16 base's, and (CUDA) how much of the
    bf16 base's step its uploads take at the pinned copy bandwidth."""
    peak = result.get("pinned_peak_gb_s")
    lines = ["\nLoRA on a quantized base against a bf16 base, per configuration (batch x "
             "tokens); upload-bound where the bf16 base's weight bytes at the pinned copy "
             "bandwidth take most of its step",
             "| config | base | tokens/s | vs bf16 | upload B/step | packed floor B/step | "
             "upload / floor | upload vs bf16 | bf16 uploads at peak / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in result["configs"]:
        bf16 = c["rows"]["bf16"]
        share = "-"
        if peak:
            upload_s = bf16["upload_bytes_per_step"] / (peak * 1e9)
            share = f"{upload_s / Figure.from_dict(bf16['step_s']).median:.2f}"
        for name, r in c["rows"].items():
            lines.append(
                f"| {c['batch']}x{c['seq']} | {name} | "
                f"{Figure.from_dict(r['tokens_per_s']).text(0)} | "
                f"{Figure.from_dict(r['tokens_vs_bf16']).text(2, 'x')} | "
                f"{int(r['upload_bytes_per_step']):,} | "
                f"{int(r['weight_floor_bytes_per_step']):,} | "
                f"{r['upload_vs_floor']:.3f} | {r['upload_vs_bf16']:.3f} | "
                f"{share if name == 'bf16' else ''} |")
    if peak:
        lines.append(f"pinned host-to-device copy peak: {peak:.1f} GB/s")
    lines.append("targets (issue 34, GPU): nf4 >= 1.3x bf16 where upload-bound (1x512), "
                 ">= 1.0x at 4x512; upload / floor 1.000")
    return "\n".join(lines)


def main(argv=None) -> None:
    """``python -m roundpipe.bench qlora [--device cuda:0]`` (also ``python -m
    roundpipe.bench.qlora``): LoRA training on a bf16 and a quantized base for each
    configuration (batch x tokens: 1 x 512, upload-bound, and 4 x 512 by default) on that
    device, and on CUDA one layer's dequantization (torch ops and the fused kernels) against
    its upload (scripts/gpu_check.sh)."""
    from . import repeats_arg

    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench qlora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--hidden", type=positive_int, default=2048,
                    help="hidden size of the LoRA training model (default 2048)")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--configs", type=config_arg, nargs="+", default=None,
                    help="BATCHxSEQ configurations (default: 1x512, upload-bound, and 4x512)")
    ap.add_argument("--seq", type=positive_int, default=None,
                    help="tokens per sequence of the default configurations (1xSEQ and 4xSEQ)")
    ap.add_argument("--bases", nargs="+", choices=sorted(BASES), default=["bf16", "nf4"],
                    help="frozen bases to train (bf16 is always first; default: bf16 nf4)")
    ap.add_argument("--layer-hidden", type=positive_int, default=4096,
                    help="hidden size of the timed layer (default 4096, Llama-7B's)")
    ap.add_argument("--layer-intermediate", type=positive_int, default=11008)
    ap.add_argument("--repeats", type=repeats_arg, default=5)
    ap.add_argument("--json", help="also write the results as JSON")
    args = ap.parse_args(argv)
    from . import write_json

    if args.configs is None:
        args.configs = [config_arg(c) for c in CONFIGS]
        if args.seq is not None:
            args.configs = [(batch, args.seq) for batch, _ in args.configs]
    elif args.seq is not None:
        ap.error("give either --configs or --seq")
    bases = ["bf16"] + [b for b in args.bases if b != "bf16"]
    cuda = args.device.startswith("cuda")
    configs = []
    for batch, seq in args.configs:
        lora = measure_training(args.hidden, args.layers, seq, args.repeats, args.device,
                                bases, batch=batch)
        print(format_table(lora))
        configs.append({"batch": batch, "seq": seq, "rows": lora["rows"]})
    result = {"model": {"hidden": args.hidden, "layers": args.layers, "device": args.device},
              "configs": configs}
    if cuda:
        from .pipeline import pinned_copy_peak_gb_s

        result["pinned_peak_gb_s"] = pinned_copy_peak_gb_s(args.device)
    print(format_configs(result))
    if cuda:
        result["layer"] = measure_cuda_layer(args.layer_hidden, args.layer_intermediate,
                                             args.repeats, args.device)
        print(format_cuda_layer(result["layer"]))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
