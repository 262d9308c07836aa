"""RoundPipeSFTTrainer against the independent reference, plain ``trl.SFTTrainer`` training the
unwrapped model (tiny float32 Llama / Qwen3, a tokenizer trained here, 20 steps, accumulation
2, warmup + cosine, clipping, weight decay): a chat (``messages``) dataset with
``assistant_only_loss``, full fine-tuning; a prompt/completion dataset with ``peft_config=``
LoRA (completion-only loss); a plain-text dataset (6 steps). Logged loss, grad_norm, learning_rate and num_tokens equal at
every step (relative 1e-4), TRL's mean_token_accuracy and entropy too (training and
evaluation), eval_loss equal, final weights equal; save_model reloads with transformers / PEFT;
packing (BFD, padding-free rows cut into microbatches at sequence starts) and padding_free
without packing log plain SFTTrainer's losses."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
import trl  # noqa: E402

from roundpipe.hf import RoundPipeSFTTrainer  # noqa: E402

import trainer_cases as tc  # noqa: E402
from trainer_cases import REL, assert_same_logs, comparison_table, reset_accelerate  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
            lora_dropout=0.0, task_type="CAUSAL_LM")


def run(cls, kind, out, dataset, eval_dataset, lora=False, **kw):
    reset_accelerate()
    tok = tc.make_tokenizer()
    model = tc.make_sft_model(kind, tok)
    extra = {"roundpipe_kwargs": {"num_microbatch": 2, "device": "cpu"}} \
        if cls is RoundPipeSFTTrainer else {}
    trainer = cls(model=model, args=tc.sft_config(out, **kw), train_dataset=dataset,
                  eval_dataset=eval_dataset, processing_class=tok,
                  peft_config=peft.LoraConfig(**LORA) if lora else None, **extra)
    trainer.train()
    return trainer


METRICS = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy")


def check_same(ours, ref, title, steps=20, evals=2):
    ref_logs, our_logs = tc.train_logs(ref.state.log_history), tc.train_logs(ours.state.log_history)
    print(f"\n{title}\n" + comparison_table(our_logs, ref_logs))
    assert len(ref_logs) == steps
    assert_same_logs(our_logs, ref_logs, keys=METRICS)
    assert [h["num_tokens"] for h in our_logs] == [h["num_tokens"] for h in ref_logs]
    ref_eval, our_eval = tc.eval_logs(ref.state.log_history), tc.eval_logs(ours.state.log_history)
    assert len(ref_eval) == len(our_eval) == evals
    for a, b in zip(our_eval, ref_eval):
        for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
            assert a[key] == pytest.approx(b[key], rel=REL), key


def test_chat_dataset_assistant_only_loss_equals_plain_sft_trainer(tmp_path):
    data, held_out = tc.chat_dataset(48), tc.chat_dataset(8, seed=9)
    ref = run(trl.SFTTrainer, "qwen3", tmp_path / "ref", data, held_out, assistant_only_loss=True)
    ours = run(RoundPipeSFTTrainer, "qwen3", tmp_path / "ours", data, held_out,
               assistant_only_loss=True)
    check_same(ours, ref, "SFT chat, assistant_only_loss, Qwen3")
    got = ours.model.state_dict()
    for name, want in ref.model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)


def test_lora_prompt_completion_equals_plain_sft_trainer_and_reloads_with_peft(tmp_path):
    data, held_out = tc.completion_dataset(48), tc.completion_dataset(8, seed=9)
    ref = run(trl.SFTTrainer, "llama", tmp_path / "ref", data, held_out, lora=True)
    ours = run(RoundPipeSFTTrainer, "llama", tmp_path / "ours", data, held_out, lora=True)
    check_same(ours, ref, "SFT LoRA, prompt/completion, Llama")
    ours.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = tc.make_sft_model("llama", tc.make_tokenizer())
    reloaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    got = reloaded.state_dict()
    for name, want in ref.model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("packing", [{"packing": True, "max_length": 40},
                                     {"padding_free": True, "max_length": None}],
                         ids=["packing", "padding_free"])
def test_packing_and_padding_free_equal_plain_sft_trainer(tmp_path, packing):
    """One padding-free row per batch (TRL's BFD packing into rows of 40 tokens, or the
    batch's sequences concatenated), cut into 2 microbatches at sequence starts; plain
    SFTTrainer keeps attention within each sequence from the position ids (no cache)."""
    data, held_out = tc.chat_dataset(48), tc.chat_dataset(8, seed=9)
    short = dict(max_steps=8, eval_steps=4, **packing)
    ref = run(trl.SFTTrainer, "llama", tmp_path / "ref", data, held_out, **short)
    ours = run(RoundPipeSFTTrainer, "llama", tmp_path / "ours", data, held_out, **short)
    check_same(ours, ref, f"SFT {next(iter(packing))}, Llama", steps=8)


def test_other_losses_are_refused(tmp_path):
    tok = tc.make_tokenizer()
    with pytest.raises(ValueError, match="loss_type"):
        RoundPipeSFTTrainer(model=tc.make_sft_model("llama", tok),
                            args=tc.sft_config(tmp_path, loss_type="dft"),
                            train_dataset=tc.chat_dataset(8), processing_class=tok)


def test_the_gradient_checkpointing_warning_names_its_own_class(tmp_path):
    tok = tc.make_tokenizer()
    with pytest.warns(UserWarning, match=r"^RoundPipeSFTTrainer: \S*gradient_checkpointing=True "
                                         "is switched off"):
        RoundPipeSFTTrainer(model=tc.make_sft_model("llama", tok),
                            args=tc.sft_config(tmp_path, gradient_checkpointing=True,
                                              eval_strategy="no"),
                            train_dataset=tc.chat_dataset(8), processing_class=tok,
                            roundpipe_kwargs={"device": "cpu"})


def test_the_sft_example_runs(tmp_path):
    """examples/sft_trl.py, LoRA, shrunk: data, training, resume, save_model, reload, generate."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "sft_trl.py")
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--lora", "--steps", "4",
                        "--hidden", "32", "--layers", "2", "--vocab", "400"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "logged the uninterrupted run's losses (largest relative difference 0.0e+00)" in r.stdout
    assert "generate() through the pipeline" in r.stdout
    assert "the same greedy tokens" in r.stdout  # the pipeline's generate() = plain transformers
    assert (tmp_path / "model" / "adapter_model.safetensors").is_file()


def test_plain_text_dataset_equals_plain_sft_trainer(tmp_path):
    import datasets

    g = torch.Generator().manual_seed(5)
    text = datasets.Dataset.from_list([{"text": tc._sentence(g, 3, 9)} for _ in range(32)])
    short = dict(max_steps=6, eval_strategy="no")
    ref = run(trl.SFTTrainer, "llama", tmp_path / "ref", text, None, **short)
    ours = run(RoundPipeSFTTrainer, "llama", tmp_path / "ours", text, None, **short)
    a, b = tc.train_logs(ours.state.log_history), tc.train_logs(ref.state.log_history)
    assert len(b) == 6
    assert_same_logs(a, b)
    assert [h["num_tokens"] for h in a] == [h["num_tokens"] for h in b]
