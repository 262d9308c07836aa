"""roundpipe.sizing against counts made here from transformers' own models (built from each
config with ``from_config`` on the meta device: no memory, exact shapes): parameters, a decoder
layer's parameters and linear weights, LoRA's adapters, and the host bytes that follow from them
(the persistent floor per trainable parameter, the NF4 base's 0.5625 bytes per frozen linear
weight); the state on a disk (host RAM: the model copy and three stages' worth of optimizer
copies and state; the rest of the floor on the disk, read and written once per step); configs
read from a folder; the command and docs/sizing.md's tables.

The host bytes per parameter are held to the memory ladder's measurement in
tests/test_memory_ladder.py. The device bound cannot be measured here (no GPU): it is the
pipeline's stated bound, computed, not checked against a device.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from roundpipe import sizing  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "sizing.md"


def meta_model(config: dict):
    """The transformers model of ``config`` (a config.json dict), on the meta device."""
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def numel(params) -> int:
    return sum(p.numel() for p in params)


SMALL = {  # the branches the built-ins do not take: biases, tied embeddings
    "llama-biased-tied": {"model_type": "llama", "vocab_size": 300, "hidden_size": 64,
                          "intermediate_size": 96, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "num_key_value_heads": 2,
                          "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "qwen3-biased": {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
                     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 24, "attention_bias": True},
}
CASES = {**{k: c for k, (_, c) in sizing.BUILTIN.items()}, **SMALL}


@pytest.mark.parametrize("name", list(CASES))
def test_parameter_counts_equal_transformers_models(name):
    config = CASES[name]
    model = meta_model(config)
    g = sizing.Geometry.from_config(config, name)
    assert g.params() == numel(model.parameters())
    layer = model.model.layers[0]
    assert g.layer_params() == numel(layer.parameters())
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert g.linear_weights() == sum(m.weight.numel() for m in linears)
    # LoRA of rank 8 on every decoder linear: A (8 x in) and B (out x 8) each
    want = sum(8 * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not model.lm_head)
    assert g.lora_params(8) == want


@pytest.mark.parametrize("name", ["llama3-70b", "qwen2.5-14b", "llama-biased-tied"])
def test_host_bytes_are_the_floor_times_the_models_parameters(name, tmp_path):
    config = CASES[name]
    model = meta_model(config)
    total = numel(model.parameters())
    decoder_linears = sum(m.weight.numel() for m in model.model.layers.modules()
                          if isinstance(m, torch.nn.Linear))
    g = sizing.Geometry.from_config(config, name)
    w = sizing.Workload(batch=2, seq=64, microbatches=2, accumulation=1, lora_rank=4)
    for m in sizing.methods():
        e = sizing.estimate(g, m, sizing.Machine(), w)
        persistent = e.host["model + optimizer copies + state"] + e.host.get("frozen base", 0)
        if not m.lora:   # every parameter trainable: model copy + optimizer copy + state
            assert e.trainable == total
            assert persistent == pytest.approx(m.floor * total, rel=1e-12)
        else:            # NF4 codes + absmax per frozen linear weight, bf16 for the rest
            lora = sum(4 * (x.in_features + x.out_features) for x in model.model.layers.modules()
                       if isinstance(x, torch.nn.Linear))
            assert e.trainable == lora
            want = 14 * lora + (32 + 4) / 64 * decoder_linears + 2 * (total - decoder_linears)
            assert persistent == pytest.approx(want, rel=1e-12)
        assert "accumulated gradient" not in e.host      # one call per step
        # every layer boundary's hidden state for the call's tokens, bf16
        assert e.host["stage inputs (activations)"] == 2 * 2 * 64 * g.hidden_size * (
            len(model.model.layers) + 1)
    e = sizing.estimate(g, sizing.methods()[0], sizing.Machine(),
                        sizing.Workload(accumulation=2))
    assert e.host["accumulated gradient"] == 4 * total


def test_a_config_json_folder_is_read_and_other_models_are_refused(tmp_path):
    transformers.AutoConfig.for_model(**sizing.BUILTIN["qwen3-8b"][1]).save_pretrained(tmp_path)
    assert sizing.geometry(str(tmp_path)).params() == sizing.geometry("qwen3-8b").params()
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="qwen3_moe.*llama, mistral, qwen2, qwen3"):
        sizing.geometry(str(moe))
    with pytest.raises(ValueError, match="llama3-70b"):
        sizing.geometry("no-such-model")


def test_the_device_bound_is_the_largest_stage_with_its_neighbour():
    """One layer per stage: the largest stage is lm_head with the final norm (Llama 3's vocabulary
    of 128k), next to a decoder layer: both stages' bf16 weights and the head's fp32 gradient
    sums. More layers per stage (what a stage planner would choose) raise the bound."""
    name = "llama3-8b"
    model = meta_model(sizing.BUILTIN[name][1])
    head = model.lm_head.weight.numel() + model.model.norm.weight.numel()
    layer = numel(model.model.layers[0].parameters())
    g, m = sizing.geometry(name), sizing.methods()[0]
    one = sizing.estimate(g, m, w=sizing.Workload(layers_per_stage=1))
    assert one.device["two stages' weights"] == 2 * (head + layer)
    assert one.device["one stage's gradient sums"] == 4 * head
    four = sizing.estimate(g, m, w=sizing.Workload(layers_per_stage=4))
    assert four.device_total > one.device_total
    with pytest.raises(ValueError, match="layers_per_stage"):
        sizing.estimate(g, m, w=sizing.Workload(layers_per_stage=0))


def test_the_command_prints_every_configuration(capsys):
    assert sizing.main(["llama3-70b", "--gpu", "24GB", "--host", "128GB"]) == 0
    out = capsys.readouterr().out
    assert "70.55B parameters" in out
    for m in sizing.methods():
        assert m.name in out
    assert sizing.parse_bytes("24GB") == sizing.parse_bytes("24") == 24 * 2 ** 30
    assert sizing.parse_bytes("1.5TB") == 1.5 * 2 ** 40
    with pytest.raises(SystemExit):
        sizing.main(["llama3-70b", "--gpu", "lots"])
    assert sizing.main(["nothing-like-it"]) == 2


def test_the_docs_table_is_the_commands():
    """docs/sizing.md's table is what ``python -m roundpipe.sizing --docs-table`` prints."""
    assert sizing.docs_table() in DOCS.read_text(), (
        "docs/sizing.md is stale: paste `python -m roundpipe.sizing --docs-table` into it")


@pytest.mark.parametrize("name", ["qwen3-1.7b", "llama3-8b", "qwen3-32b"])
def test_the_longest_sequence_is_where_the_memory_stops_fitting(name, capsys):
    """Batch 1, one microbatch: the longest sequence fits the GPU's (host's) bytes and one
    token more does not; near it, equal steps of the sequence add equal bytes (no ``S x S``
    term); a model that does not fit at all gives 0. The command prints it for every
    configuration."""
    g, machine = sizing.geometry(name), sizing.Machine()
    for m in (sizing.methods()[0], sizing.methods()[-1]):     # fp32 AdamW, NF4 base + LoRA
        def at(seq, total):
            return getattr(sizing.estimate(g, m, machine, sizing.Workload(1, seq, 1, 1)), total)

        gpu, host = sizing.longest_sequence(g, m, machine)
        for total, budget, got in (("device_total", machine.gpu_bytes, gpu),
                                   ("host_total", machine.host_bytes, host)):
            if got == 0:
                assert at(1, total) > budget
                continue
            assert at(got, total) <= budget < at(got + 1, total)
            steps = [at(got - k * 4096, total) for k in range(3)]
            assert steps[0] - steps[1] == pytest.approx(steps[1] - steps[2], rel=1e-9)
    assert sizing.main([name]) == 0
    out = capsys.readouterr().out
    assert "Longest sequence" in out
    for m in sizing.methods():
        assert m.name in out.split("Longest sequence")[1]


def test_the_long_sequence_docs_table_is_the_commands():
    """docs/sizing.md's long-sequence table is what ``--docs-long-table`` prints."""
    assert sizing.long_table() in DOCS.read_text(), (
        "docs/sizing.md is stale: paste `python -m roundpipe.sizing --docs-long-table` into it")


def test_the_state_on_a_disk_leaves_the_model_copy_and_a_window_of_three_stages():
    """llama3-8b with ``--disk``: each full fine-tuning configuration again with its optimizer
    copies and state on the disk. Host RAM: the bf16 model copy and the window, the largest
    sum of three consecutive stages in exact mode's order (lm_head, the decoder layers from the
    last, the embeddings, then lm_head again); the disk: the floor without the model copy; the
    step reads and writes it once at --disk-gbps."""
    name = "llama3-8b"
    model = meta_model(sizing.BUILTIN[name][1])
    total = numel(model.parameters())
    head = model.lm_head.weight.numel() + model.model.norm.weight.numel()
    layer = numel(model.model.layers[0].parameters())
    embed = model.model.embed_tokens.weight.numel()
    machine = sizing.Machine(host_bytes=64 * 2**30, disk_bytes=2 * 2**40, disk_gbps=7.0)
    w = sizing.Workload(batch=32, seq=2048, microbatches=16, accumulation=1)
    g, estimates = sizing.size(name, machine, w)
    on_disk = {e.method.name: e for e in estimates if e.method.on_disk}
    assert set(on_disk) == {c + ", state on disk" for c in ("fp32 AdamW", "bf16 state",
                                                              "int8 state",
                                                              "bf16 master + int8 state")}
    in_memory = {e.method.name: e for e in estimates}
    for disk_name, e in on_disk.items():
        ram = in_memory[disk_name.split(",")[0]]
        per_param = ram.method.floor - 2            # all but the bf16 model copy
        assert e.disk == pytest.approx(per_param * total, rel=1e-12)
        assert e.host["model copy"] == 2 * total
        assert "model + optimizer copies + state" not in e.host
        window = per_param * max(layer + embed + head, 2 * layer + embed, head + 2 * layer)
        assert e.host["optimizer window (3 stages)"] == pytest.approx(window, rel=1e-12)
        assert e.host_total == pytest.approx(ram.host_total - ram.method.floor * total
                                             + 2 * total + window, rel=1e-12)
        assert e.seconds["disk"] == pytest.approx(2 * per_param * total / 7e9, rel=1e-12)
        assert e.fits_disk and e.fits_host     # 64 GiB, 2 TiB
    assert not in_memory["fp32 AdamW"].fits_host
    # docs/sizing.md shows this command's output
    assert sizing.report(g, estimates) in DOCS.read_text(), (
        "docs/sizing.md is stale: paste `python -m roundpipe.sizing llama3-8b --gpu 24GB --host "
        "64GB --disk 2TB --disk-gbps 7 --batch 32 --microbatches 16 --accumulation 1` into it")
