"""The longest sequence that trains under a 24 GB device-memory cap (issue 46), beside sizing's
prediction and upstream RoundPipe's published RTX 4090 figures (Qwen3-1.7B 73K, Llama 3.1 8B
49K tokens): a Qwen3-1.7B and a Llama-3.1-8B geometry (random weights, bf16, fp32 optimizer
copies, SGD, one layer per stage as sizing assumes), one sequence per call, plain (one causal
row) and packed (one padding-free row of 4,096-token documents, ``position_ids`` restarting,
as TRL's ``padding_free``). For each
model and shape it climbs the sequence lengths of LADDER_<name> (tokens, comma separated;
defaults below) until a call fails with CUDA out of memory, and times CALLS calls (the last
timed: tokens/s) at each length that fits. Prints one line per try and writes long_seq.json
under $OUT.

    CAP_GB=24 python scripts/gpu/long_seq.py          # on a GPU with at least 24 GiB
    SMOKE=1 python scripts/gpu/long_seq.py            # dry run on the CPU: tiny models

Host RAM: the 8B needs about 80 GiB (bf16 model copy, fp32 optimizer copies and gradients).
"""

from __future__ import annotations

import gc
import os
import time

import torch

import roundpipe
import roundpipe.optim as rpo
from common import DEVICE, SMOKE, build, empty_cache, peak_gib, reset_peak, save, sync
from roundpipe import sizing

CAP_GB = float(os.environ.get("CAP_GB", "24"))
CALLS = int(os.environ.get("CALLS", "2"))
DOC = 64 if SMOKE else 4096
MODELS = {  # sizing's built-in geometry, the default ladder, upstream's published figure
    "qwen3-1.7b": ("73K,96K,128K", "73K"),
    "llama3-8b": ("49K,57K,64K", "49K"),
}


def ladder(name: str, default: str) -> list[int]:
    text = os.environ.get(f"LADDER_{name.replace('-', '_').replace('.', '_')}", default)
    seqs = [int(float(x[:-1]) * 1024) if x.endswith("K") else int(x) for x in text.split(",")]
    return [2 * DOC, 4 * DOC] if SMOKE else seqs


def config(name: str):
    from transformers import AutoConfig

    fields = dict(sizing.BUILTIN[name][1])
    if SMOKE:
        fields.update(vocab_size=320, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16)
    return AutoConfig.for_model(**fields, max_position_embeddings=1 << 18)


def inputs(cfg, seq: int, shape: str) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = {"input_ids": ids, "labels": ids}
    if shape == "packed":
        pos = (torch.arange(seq) % DOC).unsqueeze(0)
        batch = {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100)}
    return batch


def main() -> None:
    if not SMOKE:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GB * 2**30 / total), 0)
    result = {"cap_gib": CAP_GB, "models": {}}
    for name, (default, upstream) in MODELS.items():
        cfg = config(name)
        g = sizing.geometry(name)
        predicted = sizing.longest_sequence(g, sizing.methods()[0],
                                            sizing.Machine(gpu_bytes=CAP_GB * 2**30))[0]
        print(f"== {name}: sizing predicts {predicted:,} tokens on {CAP_GB:g} GiB; upstream "
              f"RoundPipe published {upstream} on an RTX 4090", flush=True)
        host = build(cfg)
        rows = result["models"][name] = {"predicted": predicted, "upstream": upstream,
                                         "shapes": {}}
        for shape in ("plain", "packed"):
            tries = rows["shapes"][shape] = []
            # one layer per stage: what sizing's prediction assumes, and no plan measured
            # under the cap
            model = roundpipe.wrap_model_to_roundpipe(host, torch.float32, device=DEVICE,
                                                      num_microbatch=1, layers_per_stage=1)
            opt = rpo.SGD(model.optim_parameters(), lr=1e-6)
            for seq in ladder(name, default):
                batch = inputs(cfg, seq, shape)
                reset_peak()
                error, seconds = None, []
                try:
                    for _ in range(CALLS):
                        start = time.time()
                        model.forward_backward(input_kwargs=batch, optimizer=opt)
                        sync()
                        seconds.append(time.time() - start)
                except torch.cuda.OutOfMemoryError as e:
                    error = str(e).splitlines()[0]
                row = {"seq": seq, "error": error, "seconds": seconds, "peak_gib": peak_gib(),
                       "tokens_per_s": seq / seconds[-1] if seconds and not error else None}
                tries.append(row)
                print(f"{name} {shape:>6} {seq:>7,} tokens: "
                      + (f"OUT OF MEMORY ({error})" if error else
                         f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_gib']:.2f} GiB")
                      , flush=True)
                if error:
                    break
            model.synchronize()
            del model, opt
            gc.collect()
            empty_cache()
        del host
        gc.collect()
        empty_cache()
    save("long_seq.json", result)


if __name__ == "__main__":
    main()
