"""Shared pieces of the Trainer tests (tests/test_trainer*.py, tests/trainer_ranks.py): tiny
float32 models built from a config (no hub), a token dataset, the TrainingArguments of the
comparison, the two runs compared (plain ``transformers.Trainer``, ``RoundPipeTrainer``) and
reading and comparing their logs."""

from __future__ import annotations

import pytest
import torch
import transformers

from roundpipe.hf import RoundPipeTrainer

VOCAB, SEQ = 96, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 causal LM ("llama" or "qwen3"), the same weights for a given seed."""
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**COMMON)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=8)
    else:
        raise ValueError(kind)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


class TokenData(torch.utils.data.Dataset):
    """Rows of random tokens, right-padded to SEQ with different lengths (so the number of
    scored tokens differs between batches): input_ids, attention_mask, labels (-100 on pads)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        lengths = torch.randint(SEQ // 3, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": torch.where(self.mask[i].bool(), self.ids[i], -100)}


def training_args(out, **overrides) -> transformers.TrainingArguments:
    """The comparison's arguments: 20 steps, accumulation 2, warmup + cosine, clipping,
    weight decay, logging every step, evaluation every 10 steps, on the CPU."""
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
              gradient_accumulation_steps=2, max_steps=20, learning_rate=3e-3, warmup_steps=3,
              lr_scheduler_type="cosine", max_grad_norm=1.15, weight_decay=0.1,
              adam_epsilon=1e-6, logging_steps=1, eval_strategy="steps", eval_steps=10,
              save_strategy="no", report_to="none", use_cpu=True, seed=7,
              dataloader_num_workers=0, disable_tqdm=True)
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def train_logs(history: list) -> list:
    """The per-step training entries of a log history (loss, grad_norm, learning_rate, epoch)."""
    return [h for h in history if "loss" in h and "train_loss" not in h]


def eval_logs(history: list) -> list:
    return [h for h in history if "eval_loss" in h]


# --- the two runs compared, and their logs -----------------------------------------------------

REL = 1e-4


def reset_accelerate():
    """accelerate keeps one process-wide state; each trainer of a test starts afresh."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def run_plain(kind, out, **overrides):
    """Plain ``transformers.Trainer`` on the unwrapped model: the reference. Returns the trainer
    and the model it trained."""
    reset_accelerate()
    model = make_model(kind)
    trainer = transformers.Trainer(model=model, args=training_args(out, **overrides),
                                   train_dataset=TokenData(48), eval_dataset=TokenData(8, 2))
    trainer.train()
    return trainer, model


def run_ours(kind, out, rp_kwargs=None, resume=None, **overrides):
    """RoundPipeTrainer on the same model, data and arguments (2 microbatches on the CPU)."""
    reset_accelerate()
    model = make_model(kind)
    trainer = RoundPipeTrainer(model=model, args=training_args(out, **overrides),
                               train_dataset=TokenData(48), eval_dataset=TokenData(8, 2),
                               roundpipe_kwargs={"num_microbatch": 2, "device": "cpu",
                                                 **(rp_kwargs or {})})
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_same_logs(ours: list, ref: list, keys=("loss", "grad_norm", "learning_rate")):
    """Both logs have the same steps and epochs, and ``keys`` equal to ``REL`` (relative)."""
    assert len(ours) == len(ref) and ref, (len(ours), len(ref))
    for a, b in zip(ours, ref):
        assert a["step"] == b["step"]
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=REL, abs=1e-12), (a["step"], k, a[k], b[k])
        if "epoch" in b:
            assert a["epoch"] == pytest.approx(b["epoch"])


def comparison_table(ours: list, ref: list) -> str:
    """Both logs side by side, printed by the tests for the reader."""
    rows = [f"{'step':>4} {'loss ours':>12} {'loss Trainer':>12} {'grad_norm ours':>14} "
            f"{'grad_norm Tr.':>14} {'lr ours':>10} {'lr Trainer':>10}"]
    for a, b in zip(ours, ref):
        rows.append(f"{a['step']:>4} {a['loss']:>12.7f} {b['loss']:>12.7f} "
                    f"{a['grad_norm']:>14.7f} {b['grad_norm']:>14.7f} "
                    f"{a['learning_rate']:>10.3e} {b['learning_rate']:>10.3e}")
    return "\n".join(rows)


# --- TRL: a tokenizer trained here, chat and prompt/completion datasets -----------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_WORDS = ("the cat sat on a mat while two dogs ran past seven red boxes and one blue kite "
          "flew over green hills near quiet rivers under bright stars").split()


def make_tokenizer():
    """A byte-level BPE tokenizer trained on a few words (no hub), with a chat template whose
    assistant turns are marked for ``assistant_only_loss``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(_WORDS)] * 4, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    out.chat_template = CHAT_TEMPLATE
    return out


def make_sft_model(kind: str, tokenizer, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(COMMON, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    cfg = (transformers.Qwen3Config(**common, head_dim=8) if kind == "qwen3"
           else transformers.LlamaConfig(**common))
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def _sentence(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi + 1, (1,), generator=g))
    return " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (n,), generator=g))


def chat_dataset(n: int, seed: int = 3):
    """``messages`` rows: a user turn and an assistant turn of random words."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": _sentence(g, 2, 5)},
                      {"role": "assistant", "content": _sentence(g, 1, 6)}]} for _ in range(n)])


def completion_dataset(n: int, seed: int = 4):
    """prompt/completion rows (TRL scores the completion only by default)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([
        {"prompt": _sentence(g, 2, 5), "completion": " " + _sentence(g, 1, 6)} for _ in range(n)])


def sft_config(out, **overrides):
    """SFTConfig for the comparison (its own defaults kept otherwise: gradient_checkpointing=True
    is one RoundPipe switches off); bf16 off on both sides (the reference would autocast)."""
    from trl import SFTConfig

    kw = dict(output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
              gradient_accumulation_steps=2, max_steps=20, learning_rate=3e-3, warmup_steps=3,
              lr_scheduler_type="cosine", max_grad_norm=0.3, weight_decay=0.1,
              adam_epsilon=1e-6, logging_steps=1, eval_strategy="steps", eval_steps=10,
              save_strategy="no", report_to="none", use_cpu=True, seed=7, bf16=False,
              dataloader_num_workers=0, disable_tqdm=True, max_length=32)
    kw.update(overrides)
    return SFTConfig(**kw)
