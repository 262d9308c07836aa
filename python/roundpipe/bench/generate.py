"""Generation benchmark: ``generate`` of a wrapped Llama-style model through the pipeline
(:mod:`roundpipe.hf.generate`) against plain transformers ``generate`` of the same model on
the same device (a model that fits there), for each batch size given (batch 1 and a large
batch by default), greedy search with a fixed number of new tokens.

Contenders (each warmed up; ``--repeats`` interleaved rounds, one ``generate`` each):

- ``transformers``: the unwrapped model moved to the device, transformers' ``DynamicCache``
  on the device;
- ``roundpipe host KV``: ``wrap_model_to_roundpipe(model, device=...)``, ``generate(...,
  kv_cache="host")``: weights streamed every step, keys and values on the host;
- ``roundpipe device KV``: the same with ``kv_cache="device"``;
- with ``--frozen-dtype nf4`` (or ``nf4-dq``, ``int8``), ``roundpipe nf4 host KV``: the same
  model, every linear but ``lm_head`` quantized (:mod:`roundpipe.quant`), host KV; its tokens
  are checked against transformers on the dequantized weights (untimed) and its tokens/s is
  also given over the bf16 ``roundpipe host KV``'s, per round (issue 34's target at batch 1:
  >= 2.5x for NF4).

Reported per contender and batch: tokens/s (new tokens of every row over the wall time of
``generate``, prefill included) with its range, the ratio to transformers measured in the
same rounds, whether the tokens equal transformers' (greedy), and for RoundPipe, from
``pipeline_stats()``: weight bytes moved per generated token against their floor (every
stage once per step, divided by the batch), KV bytes per generated token against theirs, and
the bound a streaming generate cannot beat, per round: max(compute, bytes / bandwidth), where
compute is transformers' time for the same call with the weights resident and bytes / bandwidth
the call's weight and KV bytes at the pinned host-to-device copy peak measured in this run
(CUDA; on the CPU nothing crosses a link and the bound is the compute), with the ratio of the
bound's time to RoundPipe's (issue 34's target at batch 1: >= 0.85x).

    python -m roundpipe.bench generate
    python -m roundpipe.bench generate --device cuda:0 --dtype bfloat16 --layers 16 \\
        --hidden 2048 --heads 16 --batch 1 64 --new-tokens 64 --frozen-dtype nf4 \\
        --json generate.json
"""

from __future__ import annotations

import argparse
import copy

import torch

from . import (write_json, MIN_REPEATS, Figure, interleave, paired_ratio, positive_int, repeats_arg,
               timed, writable_path)

LEGEND = """\
Columns (median over the repeats, with the min-max range):
  tok/s        new tokens of every row / wall time of one generate call (prefill included)
  x hf         tok/s over transformers' tok/s in the same round
  same         the tokens equal transformers' (greedy search)
  W B/tok      weight bytes moved host->device per generated token (floor: every stage once
               per decoding step, shared by the batch's rows)
  KV B/tok     KV cache bytes moved both ways per generated token (floor: what each layer
               attends to up once, the new entries down once)
  bound tok/s  tok/s at max(compute: transformers' time, (weight + KV bytes) / pinned copy
               peak), per round; x bound: RoundPipe's tok/s over it (1.00x: at the bound)"""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(args):
    """A Llama-style model of random weights (seeded) in ``args.dtype``, on the host."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.prompt + args.new_tokens + 8, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(DTYPES[args.dtype]).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every call makes exactly --new-tokens
    return model


def run(args) -> dict:
    """Builds the contenders, checks their tokens, times ``args.repeats`` interleaved rounds."""
    import roundpipe

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(args)
    reference = copy.deepcopy(model).to(device)
    wrapped = roundpipe.wrap_model_to_roundpipe(model, device=args.device, num_microbatch=1)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = quantized_ref = None
    if args.frozen_dtype:
        from roundpipe.quant import QuantizedLinear

        qmodel = build_model(args).requires_grad_(False)
        quantized = roundpipe.wrap_model_to_roundpipe(qmodel, device=args.device,
                                                      num_microbatch=1,
                                                      frozen_dtype=args.frozen_dtype)
        quantized_ref = build_model(args)
        with torch.no_grad():
            for name, m in qmodel.named_modules():
                if isinstance(m, QuantizedLinear):
                    quantized_ref.get_submodule(name).weight.copy_(m.weight)
        quantized_ref = quantized_ref.to(device)
    qname = f"roundpipe {args.frozen_dtype} host KV"
    peak = None
    if device.type == "cuda":
        from .pipeline import pinned_copy_peak_gb_s

        peak = pinned_copy_peak_gb_s(args.device)
    rows = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, args.vocab, (batch, args.prompt), generator=gen)
        ids_dev = ids.to(device)

        def hf_call():
            return reference.generate(ids_dev, **kw).cpu()

        def rp_call(kv):
            return lambda: wrapped.generate(ids, kv_cache=kv, **kw)

        contenders = {"transformers": hf_call, "roundpipe host KV": rp_call("host"),
                      "roundpipe device KV": rp_call("device")}
        wants = dict.fromkeys(contenders, hf_call())
        if quantized is not None:
            contenders[qname] = lambda: quantized.generate(ids, kv_cache="host", **kw)
            wants[qname] = quantized_ref.generate(ids_dev, **kw).cpu()
        same, per_token = {}, {}
        for name, fn in contenders.items():
            if name == "transformers":
                continue
            runner = quantized if name == qname else wrapped
            runner.pipeline_stats(reset=True)
            same[name] = bool(torch.equal(fn(), wants[name]))
            s = runner.pipeline_stats()
            tokens = s["generated_tokens"]
            per_token[name] = {
                "weight_bytes": s["h2d_weight_bytes"] / tokens,
                "weight_floor_bytes": s["weight_floor_bytes"] / tokens,
                "kv_bytes": (s["h2d_kv_bytes"] + s["d2h_kv_bytes"]) / tokens,
                "kv_floor_bytes": s["kv_floor_bytes"] / tokens,
                "steps": s["generate_steps"], "generated_tokens": tokens}
        seconds = interleave({k: timed(fn) for k, fn in contenders.items()}, args.repeats)
        rate = {k: [batch * args.new_tokens / t for t in v] for k, v in seconds.items()}
        for name in contenders:
            row = {"batch": batch, "contender": name,
                   "tokens_per_s": Figure.of(rate[name]).as_dict(), "samples_s": seconds[name]}
            if name != "transformers":
                row["x_transformers"] = paired_ratio(rate[name], rate["transformers"]).as_dict()
                row["same_tokens"] = same[name]
                row.update(per_token[name])
                moved = (row["weight_bytes"] + row["kv_bytes"]) * per_token[name]["generated_tokens"]
                link_s = moved / (peak * 1e9) if peak else 0.0
                bound = [batch * args.new_tokens / max(t, link_s)
                         for t in seconds["transformers"]]
                row["bound_tokens_per_s"] = Figure.of(bound).as_dict()
                row["x_bound"] = paired_ratio(rate[name], bound).as_dict()
                row["link_s"] = link_s
                if name == qname:
                    row["x_bf16_base"] = paired_ratio(rate[name],
                                                      rate["roundpipe host KV"]).as_dict()
            rows.append(row)
    return {"config": vars(args), "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": weight_bytes, "pinned_peak_gb_s": peak, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND)
    ap.add_argument("--device", default="cpu", help="compute device (default cpu)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--kv-heads", type=positive_int, default=None,
                    help="key/value heads (default: --heads)")
    ap.add_argument("--vocab", type=positive_int, default=1000)
    ap.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--new-tokens", type=positive_int, default=16,
                    help="tokens generated per row (default 16)")
    ap.add_argument("--batch", type=positive_int, nargs="+", default=[1, 16],
                    help="batch sizes (default: 1 16)")
    ap.add_argument("--repeats", type=repeats_arg, default=5,
                    help=f"interleaved rounds, at least {MIN_REPEATS} (default 5)")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                    help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--frozen-dtype", choices=["nf4", "nf4-dq", "int8"], default=None,
                    help="also generate with the linears quantized (roundpipe.quant), host KV")
    ap.add_argument("--json", type=writable_path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    result = run(args)
    print(f"generation: Llama {args.layers} layers x {args.hidden} ({result['parameters']} "
          f"parameters, {result['weight_bytes'] / 2**20:.1f} MiB), {args.dtype}, {args.device}; "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy; {args.repeats} "
          f"interleaved repeats; torch threads {args.threads}")
    print(LEGEND)
    print(f"{'batch':>5} {'contender':<20}{'tok/s (min-max)':>26}{'x hf (min-max)':>22}"
          f"{'same':>6}{'W B/tok':>12}{'floor':>12}{'KV B/tok':>11}{'floor':>11}"
          f"{'bound tok/s':>26}{'x bound':>22}")
    for r in result["rows"]:
        rate = Figure.from_dict(r["tokens_per_s"]).text(1)
        if r["contender"] == "transformers":
            print(f"{r['batch']:>5} {r['contender']:<20}{rate:>26}{'-':>22}{'-':>6}")
            continue
        ratio = Figure.from_dict(r["x_transformers"]).text(2, "x")
        print(f"{r['batch']:>5} {r['contender']:<20}{rate:>26}{ratio:>22}"
              f"{'yes' if r['same_tokens'] else 'NO':>6}{r['weight_bytes']:>12.0f}"
              f"{r['weight_floor_bytes']:>12.0f}{r['kv_bytes']:>11.0f}{r['kv_floor_bytes']:>11.0f}"
              f"{Figure.from_dict(r['bound_tokens_per_s']).text(1):>26}"
              f"{Figure.from_dict(r['x_bound']).text(2, 'x'):>22}")
    for r in result["rows"]:
        if "x_bf16_base" in r:
            print(f"batch {r['batch']}: {r['contender']} / roundpipe host KV (bf16 base): "
                  f"{Figure.from_dict(r['x_bf16_base']).text(2, 'x')} per round")
    peak = result["pinned_peak_gb_s"]
    print(f"bound: max(transformers' time, bytes / {peak:.1f} GB/s pinned copy peak)" if peak
          else "bound: transformers' time (no link: the weights are in place on the CPU)")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
