"""The main job: train a small Qwen3-architecture Hugging Face model with RoundPipe, save it as an
HF checkpoint, sample text with generate() through the pipeline and reload the checkpoint with plain
transformers (the same sample from it shows the checkpoint is standard).

The model is built from a ``Qwen3Config`` (random weights; no download) and trained on the source
text of Python's standard library, tokenised by a byte-level BPE tokenizer that this script trains
first with the ``tokenizers`` library (a second or two). ``wrap_model_to_roundpipe`` splits the
model into layers (embeddings + rotary + mask, one per decoder layer, final norm + chunked loss);
the optimizer copies are fp32, stepped by ``roundpipe.optim.AdamW`` on the CPU; each layer is
streamed to the compute device (the GPU when there is one, else the CPU) in microbatches, with
recomputation. ``--optimizer adafactor``, ``--state-dtype bfloat16|int8`` and ``--master-dtype
bfloat16`` choose the host-memory saving options (roundpipe.optim.compact; the memory ladder of
docs/host_memory.md compares their convergence with ``python -m roundpipe.bench memory``).

    python examples/train_qwen3.py                      # Python's standard library, from scratch
    python examples/train_qwen3.py --lora --model PATH  # LoRA fine-tuning of a local HF checkpoint
    python examples/train_qwen3.py --steps 600 --save-every 100
    python examples/train_qwen3.py --steps 600 --resume  # continue the run in --out exactly

Compute dtype: bf16 where the device computes it natively (CUDA; CPUs with AVX512-BF16 or AMX on
x86, the BF16 extension on Arm), fp32 elsewhere (torch emulates bf16 matmuls there at a fraction
of fp32's speed); printed at the start with the reason; ``--dtype`` overrides.

Writes to --out: ``checkpoint/`` (every --save-every steps and at the end: the full training state
for --resume), ``model/`` (the final model and tokenizer, ``from_pretrained``-loadable),
``loss.png`` and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import shlex
import shutil
import sys
import sysconfig
import time

# torch, transformers and roundpipe are imported by main() after the arguments are parsed, so that
# --help and argument errors answer at once (importing them takes seconds)
torch = roundpipe = None

SPECIAL = "<|endoftext|>"


# --- compute dtype ---------------------------------------------------------------------------------

def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, from the kernel's CPU flags (Linux)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False, "CPU features unknown (no /proc/cpuinfo)"
    flags = set()
    for line in info.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features"):
            flags.update(line.split(":", 1)[1].split())
    x86 = sorted(flags & {"avx512_bf16", "amx_bf16"})
    restricted = torch_isa_restriction()
    if x86 and restricted:
        return False, (f"the CPU has {'/'.join(x86)}, but {restricted}: bf16 matmuls would be "
                       "emulated, several times slower than fp32")
    if x86:
        return True, f"the CPU has {'/'.join(x86)}"
    if "bf16" in flags:
        return True, "the CPU has the Arm BF16 extension"
    return False, ("the CPU has no native bf16 (no AVX512-BF16/AMX, no Arm BF16): torch would "
                   "emulate bf16 matmuls, several times slower than fp32")


def torch_isa_restriction() -> str:
    """Why torch cannot use this x86 CPU's bf16 instructions although it has them: its own kernels
    (ATEN_CPU_CAPABILITY) or oneDNN (DNNL_MAX_CPU_ISA) restricted to AVX2 or below, as when
    docs/demo.md measures an AVX2-only CPU on a newer one; "" when not restricted."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("DEFAULT", "AVX2"):
        return f"torch's kernels are restricted to {capability} (ATEN_CPU_CAPABILITY)"
    dnnl = os.environ.get("DNNL_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "")).upper()
    if dnnl.startswith(("SSE", "AVX2")) or dnnl in ("AVX", "AVX512_CORE", "AVX512_CORE_VNNI"):
        return f"oneDNN is restricted to {dnnl} (DNNL_MAX_CPU_ISA)"
    return ""


def choose_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The model copy's dtype and why."""
    if requested != "auto":
        return getattr(torch, requested), "--dtype"
    if device.type == "cuda":
        return torch.bfloat16, f"{torch.cuda.get_device_name(device)} computes bf16 natively"
    native, why = cpu_bf16_native()
    return (torch.bfloat16 if native else torch.float32), why


# --- data ------------------------------------------------------------------------------------------

# folders skipped when reading a folder: installed packages (Python's standard library folder holds
# site-packages on some installations, whatever happens to be installed there), test suites (test
# data: encodings, malformed input) and the codec tables
SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}


def read_texts(path: pathlib.Path, limit: int) -> list[str]:
    """A text file, or the .py/.txt/.md/.rst files under a folder (not under a SKIP folder), up to
    ``limit`` characters; the files in a fixed shuffled order, so a partial read samples the whole
    folder (the standard library read alphabetically starts with tables of Unicode names)."""
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.suffix in {".py", ".txt", ".md", ".rst"} and p.is_file()
        and not SKIP.intersection(p.relative_to(path).parts[:-1]))
    random.Random(0).shuffle(files)
    texts, total = [], 0
    for f in files:
        texts.append(f.read_text("utf-8", "replace"))
        total += len(texts[-1])
        if total >= limit:
            break
    if total < 10_000:
        raise SystemExit(f"--data {path}: only {total} characters of text found")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2/Qwen style) trained on ``texts`` with ``tokenizers``,
    as a transformers ``PreTrainedTokenizerFast`` (saved with the model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL, bos_token=SPECIAL,
                                   pad_token=SPECIAL)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of token ids, documents separated by the end-of-text token."""
    eos = tokenizer.eos_token_id
    ids = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def split(ids: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation tokens: the stream cut into chunks of 16 sequences, every 50th
    chunk (2%) held out, so the validation text is spread over the whole data like the training
    text (the stream's tail alone is a few files, easier or harder than the rest)."""
    chunk = 16 * (seq + 1)
    n = len(ids) // chunk
    if n < 50:  # too little text for chunks: the last 2% (at least 8 sequences) held out
        size = max(len(ids) // 50, 8 * (seq + 1))
        return ids[:-size], ids[-size:]
    chunks = ids[: n * chunk].view(n, chunk)
    held = torch.arange(n) % 50 == 25
    return torch.cat([chunks[~held].flatten(), ids[n * chunk:]]), chunks[held].flatten()


# --- model -----------------------------------------------------------------------------------------

def build_model(args, vocab_size: int, tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    head_dim = args.hidden // args.heads
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=head_dim, max_position_embeddings=args.seq,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(config).float()


def add_lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                            target_modules=targets))


# --- checkpoints -------------------------------------------------------------------------------------

def save_checkpoint(folder: pathlib.Path, model, opt, schedule, scaler, gen, step: int,
                    history: dict, tokenizer, args) -> None:
    """Everything --resume needs, written to a temporary folder then renamed (a crash while
    saving keeps the previous checkpoint)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": schedule.state_dict(), "scaler": scaler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "data_rng": gen.get_state(), "history": history,
                "args": {k: str(v) for k, v in vars(args).items()}}, tmp / "trainer_state.pt")
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def load_checkpoint(folder: pathlib.Path, model, opt, schedule, scaler, gen) -> tuple[int, dict]:
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state.get("scaler", {}) or scaler.state_dict())
    torch.set_rng_state(state["torch_rng"])
    gen.set_state(state["data_rng"])
    return state["step"], state["history"]


# --- the sample ----------------------------------------------------------------------------------

def sample_text(model, tokenizer, prompt: str, args) -> str:
    """A sample continuing ``prompt``, from an HF causal LM with HF's ``generate()``: sampling at
    --temperature from the --top-k likeliest tokens, with a --repetition-penalty so that a small,
    briefly trained model does not loop on blank lines and quote marks."""
    enc = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.sample_tokens, do_sample=True,
                             temperature=args.temperature, top_k=args.top_k,
                             repetition_penalty=args.repetition_penalty,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


# --- arguments -----------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            """The message alone, first and short (argparse would print the usage of every
            option above it: twenty lines that bury it)."""
            self.exit(2, f"{self.prog}: {message}\n(--help lists every option)\n")

    # no abbreviations: the --resume command printed by --stop-after is built from the arguments
    ap = Parser(description=__doc__, formatter_class=Formatter, allow_abbrev=False)
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]),
                    help="a text file, or a folder whose .py/.txt/.md/.rst files are read, "
                         f"except under folders named {', '.join(sorted(SKIP))} "
                         "(default: Python's standard library)")
    ap.add_argument("--max-chars", type=int, default=4_000_000, help="read at most this much text")
    ap.add_argument("--model", type=pathlib.Path, default=None,
                    help="fine-tune this local HF checkpoint (with its own tokenizer) instead "
                         "of a new model")
    ap.add_argument("--lora", action="store_true",
                    help="train LoRA adapters (peft) instead of all weights (with --model: "
                         "without it the adapters sit on a new, random model)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary of the new tokenizer")
    ap.add_argument("--hidden", type=int, default=256, help="model width (new model)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (new model)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (new model)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (new model)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (in total, with --resume)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    ap.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (cosine decay)")
    ap.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--optimizer", choices=["adamw", "adafactor"], default="adamw",
                    help="roundpipe.optim.AdamW, or roundpipe.optim.Adafactor (factored second "
                         "moments, no first moment; --lr caps its relative step size)")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16", "int8"], default="float32",
                    help="how AdamW keeps its state: float32, bfloat16 (stochastic rounding) or "
                         "8-bit blockwise")
    ap.add_argument("--master-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the optimizer copies (master weights); bfloat16 steps them "
                         "with stochastic rounding")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="clip gradients to this global L2 norm (inside the optimizer step)")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                    help="dtype of the model copy, the compute dtype (the optimizer copies are "
                         "float32); auto: bf16 where the device has it natively, else fp32")
    ap.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    ap.add_argument("--val-every", type=int, default=0,
                    help="measure the validation loss every this many steps (and before the "
                         "first and after the last); 0: --steps / 10")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also write the checkpoint every this many steps (0: only at the end)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="end this run after that step (checkpoint written), as an interruption "
                         "would; it prints the --resume command that continues it")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --out/checkpoint: the same run as without interruption")
    ap.add_argument("--overwrite", action="store_true",
                    help="start afresh in an --out that holds an earlier run's checkpoint, "
                         "deleting that run's checkpoint, model, loss.png and metrics.json "
                         "(without it such an --out is refused)")
    ap.add_argument("--prompt", default="class Reader:\n    def __init__(self",
                    help="start of the generated sample")
    ap.add_argument("--sample-tokens", type=int, default=100, help="length of the generated sample")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the sample")
    ap.add_argument("--top-k", type=int, default=40, help="sample from this many likeliest tokens")
    ap.add_argument("--repetition-penalty", type=float, default=1.2,
                    help="HF generate()'s penalty on tokens already in the text (1: none)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/qwen3"),
                    help="folder for the checkpoint, the model, loss.png and metrics.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq", "microbatches", "hidden", "layers", "heads", "kv_heads",
                 "vocab", "lora_r", "sample_tokens", "top_k"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.save_every < 0 or args.val_every < 0:
        ap.error("--save-every and --val-every must be >= 0")
    if args.temperature <= 0 or args.repetition_penalty <= 0:
        ap.error("--temperature and --repetition-penalty must be > 0")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        ap.error("--stop-after must be between 1 and --steps")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.model is not None and not args.model.is_dir():
        ap.error(f"--model {args.model}: not a folder")
    if args.optimizer == "adafactor" and args.state_dtype != "float32":
        ap.error("--state-dtype applies to AdamW (Adafactor's factored state is small already)")
    checkpoint = args.out / "checkpoint" / "trainer_state.pt"
    if args.resume and args.overwrite:
        ap.error("--resume continues the run in --out, --overwrite replaces it: choose one")
    if args.resume and not checkpoint.exists():
        ap.error(f"--resume: no checkpoint in {args.out / 'checkpoint'}")
    if checkpoint.exists() and not (args.resume or args.overwrite):
        ap.error(f"--out {args.out} holds the checkpoint of an earlier run ({checkpoint.parent}); "
                 f"refusing to overwrite it. Add --resume to continue that run, --overwrite to "
                 f"replace it with a new one, or choose another --out")
    if args.lora and args.model is None:
        print("warning: --lora without --model: the LoRA adapters are trained on a NEW model with "
              "RANDOM weights, which stay random (nothing pretrained to adapt). Pass --model PATH "
              "to fine-tune a checkpoint, e.g. runs/qwen3/model from a run without --lora.",
              file=sys.stderr, flush=True)
    return args


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same one without --stop-after and
    --overwrite, with --resume. scripts/demo.sh names itself in ROUNDPIPE_DEMO_LAUNCHER."""
    launcher = os.environ.get("ROUNDPIPE_DEMO_LAUNCHER")
    if not launcher:
        exe = os.path.relpath(sys.executable)
        launcher = shlex.join([exe if not exe.startswith("..") else sys.executable, sys.argv[0]])
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--stop-after":
            skip = True
        elif not arg.startswith("--stop-after=") and arg != "--overwrite":
            kept.append(arg)
    if "--resume" not in kept:
        kept.append("--resume")
    return f"{launcher} {shlex.join(kept)}"


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


# --- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    start_all = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)  # before the heavy imports: --help answers at once
    global torch, roundpipe
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import roundpipe
    import roundpipe.optim

    hf_logging.disable_progress_bar()
    device = torch.device(args.device) if args.device else (
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    dtype, why = choose_dtype(args.dtype, device)
    print(f"compute dtype {str(dtype).removeprefix('torch.')} on {device}: {why}")

    checkpoint = args.out / "checkpoint"
    if args.overwrite and checkpoint.exists():
        for name in ("checkpoint", "checkpoint.tmp", "model", "model-merged"):
            shutil.rmtree(args.out / name, ignore_errors=True)
        for name in ("loss.png", "metrics.json"):
            (args.out / name).unlink(missing_ok=True)
        print(f"--overwrite: deleted the earlier run in {args.out} (checkpoint, model, loss.png, "
              "metrics.json)")

    torch.manual_seed(args.seed)
    texts = read_texts(args.data, args.max_chars)
    if args.resume:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        how = f"from {checkpoint}"
    elif args.model is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        how = f"from {args.model}"
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(texts, args.vocab)
        how = f"byte-level BPE trained in {time.perf_counter() - t0:.1f} s"
    ids = encode(tokenizer, texts)
    train, val = split(ids, args.seq)
    if len(train) < 8 * (args.seq + 1) or len(val) < 8 * (args.seq + 1):
        raise SystemExit(f"--data {args.data}: {len(ids)} tokens are too few for --seq {args.seq}")
    print(f"{sum(map(len, texts)):,} characters from {args.data} -> {len(ids):,} tokens "
          f"(tokenizer: {len(tokenizer):,} tokens, {how})")

    net = build_model(args, len(tokenizer), tokenizer)
    if args.lora:
        net = add_lora(net, args.lora_r)
    master = getattr(torch, args.master_dtype)
    model = roundpipe.wrap_model_to_roundpipe(net.to(dtype), master, device=device,
                                              num_microbatch=args.microbatches)
    named = list(model.optim_named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    compact = dict(stochastic_rounding=master == torch.bfloat16, seed=args.seed)
    if args.optimizer == "adafactor":
        opt = roundpipe.optim.Adafactor(groups, lr=args.lr, **compact)
    else:
        state_dtype = "int8" if args.state_dtype == "int8" else getattr(torch, args.state_dtype)
        opt = roundpipe.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                                    state_dtype=state_dtype, **compact)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for _, p in named)
    print(f"{type(model.hf_model).__name__}: {total / 1e6:.1f}M parameters, {trained / 1e6:.2f}M "
          f"trained{' (LoRA)' if args.lora else ''}; "
          f"{model.hf_model.config.num_hidden_layers + 2} pipeline layers; "
          f"{str(dtype).removeprefix('torch.')} model copy, {args.master_dtype} optimizer copies; "
          f"{type(opt).__name__} ({args.state_dtype} state), optimizer ISA "
          f"{roundpipe.optim.active_isa()}, {roundpipe.optim.num_threads()} threads")

    # fp16 needs dynamic loss scaling; clipping by the global norm happens inside the step
    scaler = roundpipe.GradScaler(enabled=dtype == torch.float16)
    gen = torch.Generator().manual_seed(args.seed)
    history = {"step": [], "loss": [], "tokens_per_s": [], "optimizer_ms": [], "grad_norm": [],
               "val_step": [], "val_loss": []}
    first = 1
    if args.resume:
        done, history = load_checkpoint(checkpoint, model, opt, schedule, scaler, gen)
        for key in ("val_step", "val_loss"):  # a checkpoint of a version without them
            history.setdefault(key, [])
        first = done + 1
        print(f"resumed from {checkpoint} after step {done}")

    def batch(source: torch.Tensor, size: int, g: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, len(source) - args.seq, (size,), generator=g)
        return torch.stack([source[i: i + args.seq] for i in idx.tolist()])

    val_every = args.val_every or max(1, args.steps // 10)
    val_x = batch(val, 16, torch.Generator().manual_seed(1234))  # the same sequences each time

    def validate(step: int | None) -> float:
        """The loss on the held-out sequences, recorded in history at ``step`` (None: not
        recorded); the model's training state and the run's random stream are left as they were
        (a resumed run stays exact)."""
        model.eval()
        with torch.random.fork_rng():
            loss = model(input_ids=val_x, labels=val_x).loss.item()
        model.train()
        if step is not None:
            history["val_step"].append(step)
            history["val_loss"].append(loss)
        return loss

    tokens = args.batch * args.seq
    last = args.steps if args.stop_after is None else args.stop_after
    t0 = time.perf_counter()
    validate(0 if first == 1 else None)  # resumed: timed only, for the expected time
    val_seconds = time.perf_counter() - t0
    # the expected time, from the first steps: the first is a warm-up (memory, threads), the
    # next `calibrate` are timed
    calibrate = 3
    print(f"training steps {first}-{last} of {args.steps}; the expected time follows from "
          f"timing the first {calibrate + 1} steps")
    expected = None
    start = time.perf_counter()
    bar = tqdm(range(first, last + 1), unit="step", dynamic_ncols=True,
               initial=first - 1, total=args.steps)
    for step in bar:
        t0 = time.perf_counter()
        x = batch(train, args.batch, gen)
        loss = model.forward_backward(input_kwargs={"input_ids": x, "labels": x},
                                      grad_scaler=scaler)
        t1 = time.perf_counter()
        model.step(opt, grad_scaler=scaler, max_grad_norm=args.clip)
        schedule.step()
        t2 = time.perf_counter()
        report = model.last_step_stats()  # recorded by the step: no extra work
        history["step"].append(step)
        history["loss"].append(loss.item())
        history["tokens_per_s"].append(tokens / (t2 - t0))
        history["optimizer_ms"].append(1e3 * (t2 - t1))
        history["grad_norm"].append(report.grad_norm)
        postfix = dict(loss=f"{loss.item():.3f}", gnorm=f"{report.grad_norm:.2f}",
                       tok_s=f"{tokens / (t2 - t0):,.0f}", opt_ms=f"{1e3 * (t2 - t1):.1f}")
        if scaler.is_enabled():
            postfix["scale"] = f"{report.scale:g}" + (" skipped" if report.skipped else "")
        bar.set_postfix(postfix)
        if step % val_every == 0 or step == args.steps:
            validate(step)
        if step == last or (args.save_every and step % args.save_every == 0):
            save_checkpoint(checkpoint, model, opt, schedule, scaler, gen, step, history,
                            tokenizer, args)
        if step == first + calibrate and step < last:
            per_step = sum(tokens / t for t in history["tokens_per_s"][-calibrate:]) / calibrate
            vals = sum(1 for s in range(step + 1, last + 1) if s % val_every == 0 or s == args.steps)
            rest = (last - step) * per_step + vals * val_seconds
            expected = time.perf_counter() - start_all + rest
            bar.write(f"expected about {minutes(expected)} for this run, {minutes(rest)} to go: "
                      f"{last - step} steps at {per_step:.2f} s (timed on steps "
                      f"{step - calibrate + 1}-{step}) and {vals} validations at "
                      f"{val_seconds:.1f} s, then a few seconds to save"
                      + (" and sample" if last == args.steps else ""))
    bar.close()
    elapsed = time.perf_counter() - start

    done_run = last == args.steps
    sample, final = None, args.out / "model"
    if done_run:
        # the round trip: an HF checkpoint, reloaded and sampled by plain transformers
        model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        if args.lora:
            model.save_pretrained(args.out / "model-merged", merged=True)
            tokenizer.save_pretrained(args.out / "model-merged")
            final = args.out / "model-merged"
        # the sample, generated through the pipeline (KV cache on the host)
        sample = sample_text(model, tokenizer, args.prompt, args)
        reloaded = AutoModelForCausalLM.from_pretrained(final).eval()
        same_sample = sample_text(reloaded, tokenizer, args.prompt, args) == sample

    history_tps = history["tokens_per_s"][first - 1:] or [0.0]  # this run's steps
    window = max(1, len(history["loss"]) // 10)
    metrics = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "dtype": str(dtype), "dtype_reason": why,
        "parameters": total, "trained_parameters": trained,
        "first_loss": history["loss"][0] if history["loss"] else None,
        "final_loss_mean_last_10pct": sum(history["loss"][-window:]) / window,
        "val_loss_before": history["val_loss"][0] if history["val_loss"] else None,
        "val_loss_after": history["val_loss"][-1] if history["val_loss"] else None,
        "tokens_per_s_median": sorted(history_tps)[len(history_tps) // 2],
        "optimizer_ms_median": sorted(history["optimizer_ms"])[len(history["optimizer_ms"]) // 2]
        if history["optimizer_ms"] else 0.0,
        "train_seconds": elapsed, "total_seconds": time.perf_counter() - start_all,
        "expected_seconds": expected, "sample": sample, "history": history,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(history, args.out / "loss.png",
         f"RoundPipe: {type(model.hf_model).__name__}, {total / 1e6:.1f}M params, "
         f"{str(dtype).removeprefix('torch.')} + {args.master_dtype} {type(opt).__name__}")

    print(f"\nloss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean_last_10pct']:.3f} "
          f"(mean of the last {window} steps)" + (
              f"; validation {metrics['val_loss_before']:.3f} (step {history['val_step'][0]}) -> "
              f"{metrics['val_loss_after']:.3f} (step {history['val_step'][-1]})"
              if history["val_loss"] else ""))
    print(f"{metrics['tokens_per_s_median']:,.0f} tokens/s (median step); optimizer step "
          f"{metrics['optimizer_ms_median']:.1f} ms (median); {minutes(metrics['total_seconds'])} "
          f"in all" + (f" (expected {minutes(expected)})" if expected else ""))
    if not done_run:
        print(f"wrote {checkpoint}, {args.out / 'loss.png'}, {args.out / 'metrics.json'}")
        print(f"stopped after step {last} of {args.steps} (--stop-after {last}), as an interruption "
              f"would. To continue this run exactly where it stopped:\n  {resume_command(argv)}")
        return
    print(f"wrote {checkpoint} (--resume), {args.out / 'model'} (save_pretrained), "
          f"{args.out / 'loss.png'} (training and validation loss), {args.out / 'metrics.json'}")
    print(f"generate() through the pipeline from {args.prompt!r}:\n" + "-" * 60 + "\n" + sample
          + "\n" + "-" * 60)
    print(f"reloaded {final} with plain transformers.AutoModelForCausalLM: "
          + ("the same sample, token for token" if same_sample else
             "its sample differs (the reload computes in its own kernels and dtype)"))


def plot(history: dict, path: pathlib.Path, title: str) -> None:
    """loss.png: the training loss of every step and the validation loss where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["loss"], lw=1, alpha=0.8, label="training (each step's batch)")
    ax.plot(history["val_step"], history["val_loss"], "o-", lw=1.5, ms=4,
            label="validation (held-out text)")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
