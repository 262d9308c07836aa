"""Supervised fine-tuning with TRL's SFTTrainer through RoundPipe: ``RoundPipeSFTTrainer``.

A small chat-format JSONL is built from local text (questions about functions of Python's
standard library, answered by the first line of their docstring), a byte-level BPE tokenizer
with a chat template is trained on it, and the demo's Qwen3-architecture model (built from a
``Qwen3Config``, or a local checkpoint with ``--model``, e.g. the ``model/`` folder that
``examples/train_qwen3.py`` writes) is fine-tuned on the assistant turns
(``assistant_only_loss``), fully or with LoRA (``--lora``). The run evaluates, checkpoints
halfway, then shows that resuming from that checkpoint logs what the uninterrupted run logged,
saves the model with ``save_model``, prints a greedy answer from ``generate()`` through the pipeline
(the wrapped model, KV cache on the host) and reloads the saved model with plain transformers (and
PEFT) to show that it answers with the same tokens.

    python examples/sft_trl.py                     # full fine-tuning, a few minutes on a CPU
    python examples/sft_trl.py --lora              # LoRA adapters only
    python examples/sft_trl.py --model runs/demo/model --lora

Writes to --out: ``chat.jsonl`` / ``chat_eval.jsonl`` (the data), ``run/checkpoint-N`` (Trainer
checkpoints with RoundPipe's state), ``model/`` (``save_model``: HF checkpoint or adapter).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import random
import time

import torch

MODULES = ("os.path", "json", "string", "textwrap", "collections", "itertools", "functools",
           "re", "math", "shutil", "pathlib", "random", "statistics", "fractions", "heapq",
           "bisect", "difflib", "base64", "csv", "glob", "fnmatch", "operator", "copy",
           "inspect", "typing", "tempfile", "zipfile", "tarfile", "datetime", "calendar")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"]


def build_chats(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """chat.jsonl and chat_eval.jsonl: one conversation per documented standard-library
    function: "What does module.name do?" -> the first line of its docstring."""
    rows = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc or getattr(obj, "__module__", mod_name) not in (mod_name, mod.__name__):
                continue
            answer = doc.strip().splitlines()[0].strip()
            if 10 <= len(answer) <= 160:
                rows.append({"messages": [
                    {"role": "user", "content": f"What does {mod_name}.{name} do?"},
                    {"role": "assistant", "content": answer}]})
    random.Random(0).shuffle(rows)
    held_out = max(16, len(rows) // 20)
    paths = out / "chat.jsonl", out / "chat_eval.jsonl"
    for path, part in zip(paths, (rows[held_out:], rows[:held_out])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"data: {len(rows) - held_out} training and {held_out} held-out conversations "
          f"from {len(MODULES)} standard-library modules -> {paths[0]}")
    return paths


def train_tokenizer(path: pathlib.Path, vocab: int):
    """A byte-level BPE tokenizer trained on the conversations, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [m["content"] for line in path.read_text().splitlines()
             for m in json.loads(line)["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    out.chat_template = CHAT_TEMPLATE
    return out


def build_model(args, tokenizer):
    """The demo's Qwen3 architecture from a config (or a local checkpoint), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.chat_template is None:
            tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
            tokenizer.chat_template = CHAT_TEMPLATE
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        if len(tokenizer) > model.config.vocab_size:
            model.resize_token_embeddings(len(tokenizer))
        return model, tokenizer
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.hidden // 4, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float(), tokenizer


def make_trainer(args, model, tokenizer, data, eval_data, max_steps: int):
    import peft
    from trl import SFTConfig

    from roundpipe.hf import RoundPipeSFTTrainer

    config = SFTConfig(
        str(args.out / "run"), per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=args.lr, warmup_steps=max(1, max_steps // 10),
        lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.01,
        logging_steps=max(1, max_steps // 10), eval_strategy="steps",
        eval_steps=max(1, max_steps // 2), save_strategy="steps",
        save_steps=max(1, max_steps // 2), save_total_limit=2, assistant_only_loss=True,
        max_length=96, bf16=torch.cuda.is_available(), report_to="none", seed=0,
        disable_tqdm=True)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"]) \
        if args.lora else None
    return RoundPipeSFTTrainer(model=model, args=config, train_dataset=data,
                               eval_dataset=eval_data, processing_class=tokenizer,
                               peft_config=lora, roundpipe_kwargs={"num_microbatch": 2})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/sft_trl"))
    ap.add_argument("--model", help="fine-tune this local HF checkpoint instead of a new model")
    ap.add_argument("--lora", action="store_true", help="LoRA adapters instead of all weights")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    start = time.perf_counter()
    import datasets
    from transformers import AutoModelForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = build_chats(args.out)
    data = datasets.load_dataset("json", data_files=str(train_path), split="train")
    eval_data = datasets.load_dataset("json", data_files=str(eval_path), split="train")
    tokenizer = train_tokenizer(train_path, args.vocab)
    model, tokenizer = build_model(args, tokenizer)

    trainer = make_trainer(args, model, tokenizer, data, eval_data, args.steps)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    print(f"trained {args.steps} steps: loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}, "
          f"eval_loss {' -> '.join(f'{e:.3f}' for e in evals)}")

    # resume from the halfway checkpoint: a new trainer on a new model logs the same losses
    half = max(1, args.steps // 2)
    fresh, tokenizer = build_model(args, tokenizer)
    resumed = make_trainer(args, fresh, tokenizer, data, eval_data, args.steps)
    resumed.train(resume_from_checkpoint=str(args.out / "run" / f"checkpoint-{half}"))
    again = [h for h in resumed.state.log_history
             if "loss" in h and "train_loss" not in h and h["step"] > half]
    first = {h["step"]: h["loss"] for h in logs}
    diff = max(abs(h["loss"] - first[h["step"]]) / abs(first[h["step"]]) for h in again)
    print(f"resumed from checkpoint-{half}: steps {again[0]['step']}..{again[-1]['step']} logged "
          f"the uninterrupted run's losses (largest relative difference {diff:.1e})")

    resumed.save_model(str(args.out / "model"))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does os.path.join do?"}], add_generation_prompt=True,
        tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    greedy = dict(max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    ours = resumed.model.generate(ids, **greedy)      # through the pipeline, KV cache on the host
    answer = tokenizer.decode(ours[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"generate() through the pipeline: What does os.path.join do? -> {answer.strip()!r}")
    if args.lora:
        import peft

        base, _ = build_model(args, tokenizer)
        reloaded = peft.PeftModel.from_pretrained(base, str(args.out / "model")).merge_and_unload()
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(str(args.out / "model"))
    out = reloaded.generate(ids, **greedy)
    same = out.shape == ours.shape and torch.equal(out, ours)
    print(f"reloaded {args.out / 'model'} with plain transformers{' + PEFT' if args.lora else ''}: "
          + ("the same greedy tokens" if same else "different tokens: " + repr(
              tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())))
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
