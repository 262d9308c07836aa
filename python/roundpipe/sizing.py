"""Will it fit, and how fast? Host RAM and GPU memory a decoder-only model needs with RoundPipe,
and the tokens/s bound of a training step, for each way of keeping the optimizer's side of a
parameter (the host-memory ladder of docs/host_memory.md) and for LoRA on a 4-bit (NF4) base.

    python -m roundpipe.sizing llama3-70b --gpu 24GB --host 128GB
    python -m roundpipe.sizing path/to/model --batch 4 --seq 4096   # a folder with config.json
    python -m roundpipe.sizing --list                                # the built-in geometries

Everything is computed from the model's configuration (Llama, Mistral, Qwen2, Qwen3: dense
decoder-only; the parameter counts are exact, checked against transformers' models in
tests/test_sizing.py) and from machine figures given as options, whose defaults say where they
come from (:class:`Machine`). Sizes are in GiB (2**30 bytes): a "24 GB" card has 24 GiB.

**Host memory** (exact overlapped mode, ``forward_backward(..., optimizer=opt)``, one call per
step, as the ladder measures it; several calls per step add the accumulated gradient, 4 bytes
per trainable parameter):

- persistent: per trainable parameter the configuration's floor (model copy + optimizer copy +
  optimizer state: 14 bytes for fp32 AdamW, ..., see ``roundpipe.bench.memory.CONFIGS``); for
  LoRA on an NF4 base, the frozen linear weights at 0.5625 bytes (4-bit codes and a float32
  absmax per 64 values) and the other frozen weights (embeddings, norms, ``lm_head``) at 2;
- the stage inputs the forward pass keeps for the backward: every layer boundary's hidden
  state for the call's tokens (bf16);
- in flight: a stage's downloaded fp32 gradient sums, two at a time (one consumed by the
  optimizer thread, one waiting);
- ``host_reserve`` for the OS and the process's fixed costs (a stated allowance).

tests/test_memory_ladder.py holds this prediction to the ladder's measured bytes per parameter.

**Device memory at the bound** (what the pipeline promises, docs/overlap.md: two stages'
weights, one stage's gradient sums, one microbatch's activations, plus a stated fixed
allowance), for the largest stage, with ``layers_per_stage`` pipeline layers per stage (the
pipeline's layers: the embeddings, each decoder layer, the final norm with ``lm_head``):

- weights in the model dtype (bf16) of the stage and of its larger neighbour (the next upload);
  an NF4 base uploads its 0.5625-byte codes and dequantizes the stage's linears to bf16;
- the stage's fp32 gradient sums (4 bytes per trainable parameter);
- one microbatch's activations: an estimate of what a decoder layer saves for its backward,
  ``2 * tokens * (6*hidden + 3*q_dim + 3*kv_dim + 4*intermediate)`` bytes, doubled for the
  gradients that exist alongside at the backward's peak; for the last stage the chunked loss's
  fp32 logits and their gradient, ``2 * 4 * loss_chunk * vocab`` bytes.

This is the bound the pipeline is built to keep (docs/overlap.md), not a measurement: the
first run on a GPU (an H200) held more than it, and no 24 GB card has been measured; read it as
what a model needs, not a guarantee.

**State on a disk** (``--disk SIZE``, ``RoundPipe(..., optimizer_dir=...)``; rows
"..., state on disk"): the optimizer copies and state live in files, and host RAM holds the
model copy (2 bytes per parameter; for bf16 master weights it is the master) and the window
through which each stage's optimizer copies and state stream, three stages' worth (the one
written, the one stepped, the one read ahead: the largest sum of three stages in a row of exact
mode's order, which wraps from the embeddings to ``lm_head``). The disk holds the rest of the
floor per trainable parameter (12 bytes for fp32 AdamW: master and two moments; 2.03 for bf16
master + int8 state) and a step reads and writes all of it once: a fourth bound, the disk, at
``disk_gbps`` for that mix of reads and writes.

**Tokens/s bound** of an optimizer step of ``batch * seq * accumulation`` tokens, overlapped
(the step time is the largest of the three): the GPU's matmuls (8 FLOPs per parameter and
token: forward, recomputation, backward; 6 without weight gradients of a frozen base; plus
causal attention) at ``gpu_tflops``; the PCIe bytes (each stage's weights up twice per call,
the gradient sums down once, the hidden states of every layer boundary up three times and
down twice) at ``pcie_gbps`` per direction; the host optimizer step (the bytes its fused
kernel moves per trainable parameter) at ``host_gbps`` times the fraction of the byte floor
each configuration's kernel reached (docs/host_memory.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

GIB = 2 ** 30

#: pipeline layers per stage assumed for the device bound: one, the least a model needs (the
#: CPU device's default); on CUDA the stage planner (``layers_per_stage="auto"``) packs more
#: layers per stage, each stage within half of ``memory_budget`` (see ``--layers-per-stage``)
LAYERS_PER_STAGE = 1

NF4_BYTES = 0.5625          # 4-bit codes + one float32 absmax per 64 values (roundpipe.quant)
MODEL_BYTES = 2             # bf16 model copy, uploads, activations
GRAD_SUM_BYTES = 4          # fp32 gradient sums, on the device and downloaded
IN_FLIGHT_DOWNLOADS = 2     # downloaded gradient sums on the host at once
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- the model's geometry ---------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """A dense decoder-only transformer's sizes, named as in its transformers config.

    ``qkv_bias``: biases on q/k/v (Qwen2; Llama's and Qwen3's ``attention_bias``);
    ``o_bias``: on o_proj (``attention_bias``); ``mlp_bias``: on the MLP's three linears
    (Llama's ``mlp_bias``); ``qk_norm``: RMSNorm weights on q and k per head (Qwen3)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """A decoder layer's linears: name -> (in_features, out_features)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_weights(self) -> int:
        """Weights of a decoder layer's linears (what a 4-bit base quantizes)."""
        return sum(a * b for a, b in self.linears().values())

    def layer_params(self) -> int:
        """Every parameter of one decoder layer."""
        h = self.hidden_size
        biases = ((self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias
                  + (2 * self.intermediate_size + h) * self.mlp_bias)
        norms = 2 * h + 2 * self.head_dim * self.qk_norm
        return self.linear_weights() + biases + norms

    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """The final norm and ``lm_head`` (none when tied to the embeddings)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.embed_params())

    def params(self) -> int:
        """Every parameter (a tied ``lm_head`` counted once, as ``parameters()`` does)."""
        return self.embed_params() + self.num_hidden_layers * self.layer_params() \
            + self.head_params()

    def lora_params(self, rank: int, targets: tuple = LORA_TARGETS) -> int:
        """LoRA's A and B of rank ``rank`` on the named linears of every decoder layer."""
        return self.num_hidden_layers * sum(rank * (a + b) for n, (a, b) in
                                            self.linears().items() if n in targets)

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> "Geometry":
        """From a transformers ``config.json`` (as a dict) of a Llama, Mistral, Qwen2 or Qwen3
        model.

        Raises:
            ValueError: another ``model_type`` (mixture-of-experts, multimodal, ...), naming
                those supported.
        """
        kind = config.get("model_type")
        if kind not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"roundpipe.sizing: model_type {kind!r} is not supported; it sizes "
                             "dense Llama, Mistral, Qwen2 and Qwen3 models (model_type llama, "
                             "mistral, qwen2, qwen3)")
        heads = int(config["num_attention_heads"])
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            name=name or config.get("_name_or_path", "") or kind,
            vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or (attention_bias and kind in ("llama", "qwen3")),
            o_bias=attention_bias and kind in ("llama", "qwen3"),
            mlp_bias=bool(config.get("mlp_bias", False)) and kind == "llama",
            qk_norm=kind == "qwen3")


# built-in geometries: the config.json fields of the published checkpoints, as
# (title, model_type, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
#  num_attention_heads, num_key_value_heads, head_dim or None: hidden_size / heads[, other fields])
_PUBLISHED = {
    "qwen3-1.7b": ("Qwen3 1.7B", "qwen3", 151936, 2048, 6144, 28, 16, 8, 128,
                   {"tie_word_embeddings": True}),
    "llama2-7b": ("Llama 2 7B", "llama", 32000, 4096, 11008, 32, 32, 32, None),
    "mistral-7b": ("Mistral 7B v0.1", "mistral", 32000, 4096, 14336, 32, 32, 8, None),
    "llama3-8b": ("Llama 3.1 8B", "llama", 128256, 4096, 14336, 32, 32, 8, None),
    "qwen3-8b": ("Qwen3 8B", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128),
    "qwen2.5-14b": ("Qwen2.5 14B", "qwen2", 152064, 5120, 13824, 48, 40, 8, None),
    "qwen3-14b": ("Qwen3 14B", "qwen3", 151936, 5120, 17408, 40, 40, 8, 128),
    "qwen2.5-32b": ("Qwen2.5 32B", "qwen2", 152064, 5120, 27648, 64, 40, 8, None),
    "qwen3-32b": ("Qwen3 32B", "qwen3", 151936, 5120, 25600, 64, 64, 8, 128),
    "llama3-70b": ("Llama 3.1 70B", "llama", 128256, 8192, 28672, 80, 64, 8, None),
}
_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim")

#: built-in name -> (title, its config.json fields)
BUILTIN = {key: (title, {**{k: v for k, v in zip(_FIELDS, values) if v is not None},
                         **(values[len(_FIELDS)] if len(values) > len(_FIELDS) else {})})
           for key, (title, *values) in _PUBLISHED.items()}


def geometry(model: str) -> Geometry:
    """A built-in name (:data:`BUILTIN`), a folder holding ``config.json`` or the file itself.

    Raises:
        ValueError: neither (the message lists the built-in names), or a config it does not
            size (see :meth:`Geometry.from_config`).
    """
    if model in BUILTIN:
        title, config = BUILTIN[model]
        return Geometry.from_config(config, f"{title} ({model})")
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"roundpipe.sizing: {model!r} is neither a built-in model "
                         f"({', '.join(BUILTIN)}) nor a folder or file holding a transformers "
                         "config.json")
    with open(path) as f:
        return Geometry.from_config(json.load(f), model)


# --- configurations and the machine ----------------------------------------------------------

@dataclass(frozen=True)
class Method:
    """A way of keeping a trainable parameter's host state (the ladder's rows, plus LoRA on a
    4-bit base): ``floor`` bytes per trainable parameter (model copy + optimizer copy +
    state), ``step_bytes`` the bytes its fused step moves per element, ``step_efficiency``
    the fraction of its byte floor the step reached (one thread, docs/host_memory.md: compact
    state is compute-bound there and scales with threads, so this is pessimistic);
    ``lora``: the decoder layers' linears frozen in NF4, LoRA adapters trained with fp32 AdamW."""

    name: str
    floor: float
    step_bytes: float
    step_efficiency: float
    lora: bool = False
    on_disk: bool = False

    @property
    def disk_floor(self) -> float:
        """Bytes per trainable parameter in files when on a disk: the floor without the model
        copy (which stays in host RAM)."""
        return self.floor - MODEL_BYTES if self.on_disk else 0.0


DISK_SUFFIX = ", state on disk"


def methods(disk: bool = False) -> list[Method]:
    """The ladder's five configurations (``roundpipe.bench.memory.CONFIGS``) and LoRA (rank
    ``--lora-rank``) on an NF4 base with fp32 AdamW; with ``disk``, the ladder's full
    fine-tuning configurations again with their optimizer copies and state on a disk
    (Adafactor's state is small already)."""
    from .bench.memory import CONFIGS

    # % of byte floor of the pipeline's fused step, docs/host_memory.md (2026-12-02, one thread)
    efficiency = {"fp32 AdamW": 0.93, "bf16 state": 0.73, "int8 state": 0.42,
                  "bf16 master + int8 state": 0.20, "Adafactor": 0.57}
    out = [Method(c.name, c.floor, c.step_bytes, efficiency[c.name]) for c in CONFIGS]
    adamw = CONFIGS[0]
    out.append(Method("NF4 base + LoRA", adamw.floor, adamw.step_bytes, efficiency[adamw.name],
                      lora=True))
    if disk:
        out += [Method(c.name + DISK_SUFFIX, c.floor, c.step_bytes, efficiency[c.name],
                       on_disk=True) for c in CONFIGS if c.optimizer != "adafactor"]
    return out


@dataclass(frozen=True)
class Machine:
    """The machine figures a bound is computed from (``python -m roundpipe.sizing --help``
    says where each default comes from)."""

    gpu_bytes: float = 24 * GIB
    host_bytes: float = 128 * GIB
    host_reserve: float = 8 * GIB
    pcie_gbps: float = 25.0
    host_gbps: float = 62.0
    gpu_tflops: float = 80.0
    fixed_device: float = 1 * GIB
    disk_bytes: float = 0.0   # a disk for the optimizer state (0: none)
    disk_gbps: float = 7.0


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``accumulation`` calls of ``batch`` sequences of ``seq`` tokens,
    each call in ``microbatches`` microbatches; ``lora_rank`` for LoRA; ``loss_chunk``: tokens
    per chunk of the chunked loss (``loss_chunk_size``); ``layers_per_stage``: see
    :data:`LAYERS_PER_STAGE`."""

    batch: int = 8
    seq: int = 2048
    microbatches: int = 4
    accumulation: int = 4
    lora_rank: int = 16
    loss_chunk: int = 1024
    layers_per_stage: int = LAYERS_PER_STAGE

    @property
    def tokens_per_call(self) -> int:
        return self.batch * self.seq

    @property
    def tokens_per_microbatch(self) -> int:
        return math.ceil(self.batch / self.microbatches) * self.seq

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_call * self.accumulation


@dataclass
class Estimate:
    """One configuration's answer: bytes (host, device) with their parts, whether each fits,
    the seconds per optimizer step of each bound and the tokens/s of the largest."""

    method: Method
    trainable: int
    host: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    disk: float = 0.0
    seconds: dict = field(default_factory=dict)
    machine: Machine = field(default_factory=Machine)
    workload: Workload = field(default_factory=Workload)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def fits_host(self) -> bool:
        return self.host_total <= self.machine.host_bytes

    @property
    def fits_gpu(self) -> bool:
        return self.device_total <= self.machine.gpu_bytes

    @property
    def fits_disk(self) -> bool:
        return self.disk <= self.machine.disk_bytes

    @property
    def bound_by(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    @property
    def tokens_per_s(self) -> float:
        return self.workload.tokens_per_step / max(self.seconds.values())


# --- the estimate -------------------------------------------------------------------------------

def host_parts(m: Method, trainable: int, stage_grads: int, stage_inputs: float,
               accumulation: int = 1, frozen: float = 0.0) -> dict:
    """Host bytes of a model trained with ``m``, by part (the reserve not included):
    ``trainable`` parameters at ``m.floor``, ``frozen`` bytes of a frozen base, the
    accumulated gradient when ``accumulation`` > 1, ``stage_inputs`` bytes of hidden states
    kept for the backward, and :data:`IN_FLIGHT_DOWNLOADS` fp32 gradient sums of the largest
    stage (``stage_grads`` elements). The same terms hold on the CPU device (its gradient sums
    are in host memory, its weights used in place): tests/test_memory_ladder.py compares them
    with the ladder's measurement."""
    out = {}
    if frozen:
        out["frozen base"] = frozen
    if m.on_disk:
        out["model copy"] = MODEL_BYTES * trainable
    else:
        out["model + optimizer copies + state"] = m.floor * trainable
    if accumulation > 1:
        out["accumulated gradient"] = GRAD_SUM_BYTES * trainable
    out["stage inputs (activations)"] = stage_inputs
    out["gradient downloads in flight"] = IN_FLIGHT_DOWNLOADS * GRAD_SUM_BYTES * stage_grads
    return out


def _layer_table(g: Geometry, m: Method, w: Workload) -> list[dict]:
    """Per pipeline layer (embeddings, decoder layers, final norm + lm_head): bytes uploaded
    (``weights``), bf16 bytes of dequantized weights while it runs (``dequant``), trainable
    parameters (``trainable``; a tied ``lm_head`` counted with the embeddings) and the
    gradient sums the layer makes on the device (``grads``; a tied one in both stages),
    activation bytes of one microbatch (``act``)."""
    t, h = w.tokens_per_microbatch, g.hidden_size
    lora_layer = g.lora_params(w.lora_rank) // g.num_hidden_layers if m.lora else 0
    embed = {"weights": MODEL_BYTES * g.embed_params(), "dequant": 0,
             "trainable": 0 if m.lora else g.embed_params(), "act": 2 * MODEL_BYTES * t * h}
    embed["grads"] = embed["trainable"]
    if m.lora:
        frozen_linear = g.linear_weights()
        weights = (NF4_BYTES * frozen_linear + MODEL_BYTES * (g.layer_params() - frozen_linear)
                   + MODEL_BYTES * lora_layer)
        dequant = MODEL_BYTES * frozen_linear
    else:
        weights, dequant = MODEL_BYTES * g.layer_params(), 0
    saved = MODEL_BYTES * t * (6 * h + 3 * g.q_dim + 3 * g.kv_dim + 4 * g.intermediate_size)
    decoder = {"weights": weights, "dequant": dequant,
               "trainable": lora_layer if m.lora else g.layer_params(), "act": 2 * saved}
    decoder["grads"] = decoder["trainable"]
    chunk = min(w.loss_chunk, t)
    head = {"weights": MODEL_BYTES * (g.hidden_size + g.embed_params()), "dequant": 0,
            "trainable": 0 if m.lora else g.head_params(),
            "grads": 0 if m.lora else g.hidden_size + g.embed_params(),
            "act": 2 * 4 * chunk * g.vocab_size + 3 * MODEL_BYTES * t * h}
    return [embed] + [decoder] * g.num_hidden_layers + [head]


def _stages(layers: list[dict], per_stage: int) -> list[dict]:
    """Consecutive layers summed into stages of ``per_stage`` layers (activations: the
    largest layer's, as one layer runs at a time)."""
    out = []
    for s in range(0, len(layers), per_stage):
        part = layers[s:s + per_stage]
        out.append({"weights": sum(x["weights"] for x in part),
                    "dequant": max(x["dequant"] for x in part),
                    "trainable": sum(x["trainable"] for x in part),
                    "grads": sum(x["grads"] for x in part),
                    "act": max(x["act"] for x in part)})
    return out


def estimate(g: Geometry, m: Method, machine: Machine = Machine(),
             w: Workload = Workload()) -> Estimate:
    """Host bytes, device bytes at the bound and the tokens/s bound of training ``g`` with
    ``m`` (see the module docstring for every term).

    Raises:
        ValueError: a workload or machine figure that is not positive (named).
    """
    for name in ("batch", "seq", "microbatches", "accumulation", "lora_rank", "loss_chunk",
                 "layers_per_stage"):
        if getattr(w, name) < 1:
            raise ValueError(f"roundpipe.sizing: {name} must be >= 1, got {getattr(w, name)}")
    for name in ("gpu_bytes", "host_bytes", "pcie_gbps", "host_gbps", "gpu_tflops",
                 "disk_gbps"):
        if not getattr(machine, name) > 0:
            raise ValueError(f"roundpipe.sizing: {name} must be > 0, got {getattr(machine, name)}")
    layers = _layer_table(g, m, w)
    stages = _stages(layers, w.layers_per_stage)
    trainable = sum(x["trainable"] for x in layers)
    e = Estimate(m, trainable, machine=machine, workload=w)

    # host
    frozen = 0.0
    if m.lora:
        linear = g.num_hidden_layers * g.linear_weights()
        frozen = NF4_BYTES * linear + MODEL_BYTES * (g.params() - linear)
    hidden_bytes = MODEL_BYTES * w.tokens_per_call * g.hidden_size * (len(layers) - 1)
    e.host = host_parts(m, trainable, max(s["grads"] for s in stages), hidden_bytes,
                        w.accumulation, frozen)
    if m.on_disk:  # three stages in a row of exact mode's order (descending, wrapping)
        units = [m.disk_floor * s["trainable"] for s in reversed(stages) if s["trainable"]]
        e.host["optimizer window (3 stages)"] = max(
            sum(units[(k + j) % len(units)] for j in range(min(3, len(units))))
            for k in range(len(units)))
        e.disk = m.disk_floor * trainable
    e.host["reserve (OS, process)"] = machine.host_reserve

    # device: the stage whose visit holds the most
    def resident(k: int) -> tuple:
        s = stages[k]
        neighbour = max([stages[j]["weights"] for j in (k - 1, k + 1) if 0 <= j < len(stages)],
                        default=0)
        return (s["weights"] + neighbour, s["dequant"], GRAD_SUM_BYTES * s["grads"], s["act"])

    parts = max((resident(k) for k in range(len(stages))), key=sum)
    e.device = {"two stages' weights": parts[0], "dequantized weights": parts[1],
                "one stage's gradient sums": parts[2], "one microbatch's activations": parts[3],
                "fixed allowance": machine.fixed_device}

    # time per optimizer step
    matmul = g.num_hidden_layers * g.linear_weights() + g.embed_params()  # + lm_head's product
    flops_per_token = (6 if m.lora else 8) * matmul \
        + 8 * g.num_hidden_layers * w.seq * g.q_dim   # causal attention, 4 passes
    e.seconds["GPU compute"] = w.tokens_per_step * flops_per_token / (machine.gpu_tflops * 1e12)
    up = 2 * sum(s["weights"] for s in stages) + 3 * hidden_bytes
    down = GRAD_SUM_BYTES * sum(s["grads"] for s in stages) + 2 * hidden_bytes
    e.seconds["PCIe"] = w.accumulation * max(up, down) / (machine.pcie_gbps * 1e9)
    e.seconds["host optimizer step"] = (trainable * m.step_bytes
                                        / (machine.host_gbps * 1e9 * m.step_efficiency))
    if m.on_disk:  # read and written once per step
        e.seconds["disk"] = 2 * e.disk / (machine.disk_gbps * 1e9)
    return e


def longest_sequence(g: Geometry, m: Method, machine: Machine = Machine(),
                     w: Workload = Workload(), limit: int = 1 << 24) -> tuple[int, int]:
    """The longest sequence, in tokens, that one call of one sequence (batch 1, one
    microbatch, one call per optimizer step; ``w``'s LoRA rank, loss chunk and layers per
    stage) can train with ``m``: ``(on the GPU, in host RAM)``, each the largest ``seq`` whose
    :func:`estimate` fits ``machine.gpu_bytes`` / ``machine.host_bytes``; 0 where not even one
    token fits (the model alone is too large), ``limit`` where ``limit`` tokens still fit.

    Every term that grows with the sequence is linear in it (attention within segments,
    :mod:`roundpipe.hf.attention`: no ``S x S`` mask; the chunked loss; the hidden states of
    every layer boundary on the host), so each bound is where a straight line crosses the
    memory: found by bisection on :func:`estimate` itself."""
    def fits(seq: int, gpu: bool) -> bool:
        e = estimate(g, m, machine, Workload(1, seq, 1, 1, w.lora_rank, w.loss_chunk,
                                             w.layers_per_stage))
        return e.fits_gpu if gpu else e.fits_host

    out = []
    for gpu in (True, False):
        lo, hi = 0, limit  # fits(lo) (0: vacuously), the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, gpu) else (lo, mid - 1)
        out.append(lo)
    return out[0], out[1]


def _tokens(n: int, limit: int = 1 << 24) -> str:
    return "does not fit" if n == 0 else (f">= {n:,}" if n >= limit else f"{n:,}")


def longest_report(g: Geometry, machine: Machine = Machine(), w: Workload = Workload()) -> str:
    """The block ``python -m roundpipe.sizing`` prints after its table: per configuration, the
    longest sequence (:func:`longest_sequence`) on the GPU and in host RAM."""
    lines = [f"Longest sequence (tokens; one sequence per call, one microbatch, one call per "
             f"step) on {_gib(machine.gpu_bytes)} GiB GPU / {_gib(machine.host_bytes)} GiB host:",
             f"{'configuration':<26} {'GPU':>14} {'host RAM':>14}"]
    for m in methods():
        gpu, host = longest_sequence(g, m, machine, w)
        lines.append(f"{m.name:<26} {_tokens(gpu):>14} {_tokens(host):>14}")
    return "\n".join(lines)


#: docs/sizing.md's long-sequence table: models, GPU sizes, host sizes (GiB), and upstream
#: RoundPipe's published longest sequences on an RTX 4090 (its README)
LONG_MODELS = {"qwen3-1.7b": "73K", "llama3-8b": "49K", "qwen3-32b": "28K"}
LONG_GPUS = (24, 80)
LONG_HOSTS = (128, 256)


def long_table(w: Workload = Workload(), machine: Machine = Machine()) -> str:
    """The markdown table of docs/sizing.md's long sequences: for :data:`LONG_MODELS` and each
    configuration, the longest sequence on each of :data:`LONG_GPUS` and in each of
    :data:`LONG_HOSTS` GiB of host RAM, the other figures at their defaults."""
    from dataclasses import replace

    rows = ["| model | configuration | " + " | ".join(f"{x} GiB GPU" for x in LONG_GPUS) + " | "
            + " | ".join(f"{x} GiB RAM" for x in LONG_HOSTS) + " | upstream, RTX 4090 |",
            "|---|---|" + "---:|" * (len(LONG_GPUS) + len(LONG_HOSTS)) + "---:|"]
    for model, upstream in LONG_MODELS.items():
        g = geometry(model)
        for k, m in enumerate(methods()):
            gpus = [longest_sequence(g, m, replace(machine, gpu_bytes=x * GIB), w)[0]
                    for x in LONG_GPUS]
            hosts = [longest_sequence(g, m, replace(machine, host_bytes=x * GIB), w)[1]
                     for x in LONG_HOSTS]
            rows.append(f"| {g.name.split(' (')[0]} | {m.name} | "
                        + " | ".join(_tokens(n) for n in gpus + hosts)
                        + f" | {upstream if k == 0 else ''} |")
    return "\n".join(rows)


def size(model: str, machine: Machine = Machine(), w: Workload = Workload()) -> tuple:
    """``(geometry, [estimate of each method])`` for ``model`` (see :func:`geometry`); the
    configurations on a disk when ``machine.disk_bytes`` is set."""
    g = geometry(model)
    return g, [estimate(g, m, machine, w) for m in methods(machine.disk_bytes > 0)]


# --- the command --------------------------------------------------------------------------------

def parse_bytes(text: str) -> float:
    """``"24GB"``, ``"24G"``, ``"24GiB"``, ``"1.5TB"`` or a bare number of GiB, as bytes (GB
    read as GiB: memory is sold in binary units).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:(G|T)(?:i?B)?)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 24GB or 1.5TB")
    value = float(m.group(1)) * GIB
    return value * 1024 if (m.group(2) or "G").upper() == "T" else value


def _gib(b: float) -> str:
    return f"{b / GIB:,.1f}"


def report(g: Geometry, estimates: list[Estimate]) -> str:
    """The table ``python -m roundpipe.sizing`` prints."""
    e0 = estimates[0]
    mc, w = e0.machine, e0.workload
    disk = [e for e in estimates if e.method.on_disk]
    lines = [
        f"{g.name}: {g.params() / 1e9:.2f}B parameters ({g.num_hidden_layers} layers x "
        f"{g.hidden_size}, vocabulary {g.vocab_size:,})",
        f"{w.batch} x {w.seq} tokens per call in {w.microbatches} microbatches, "
        f"{w.accumulation} calls per optimizer step ({w.tokens_per_step:,} tokens), "
        f"layers_per_stage={w.layers_per_stage}, LoRA rank {w.lora_rank}",
        f"GPU {_gib(mc.gpu_bytes)} GiB ({mc.gpu_tflops:g} TFLOPS, {_gib(mc.fixed_device)} GiB "
        f"fixed), host {_gib(mc.host_bytes)} GiB ({_gib(mc.host_reserve)} GiB reserved), PCIe "
        f"{mc.pcie_gbps:g} GB/s, host step {mc.host_gbps:g} GB/s"
        + (f", disk {_gib(mc.disk_bytes)} GiB at {mc.disk_gbps:g} GB/s" if disk else ""),
        "",
        f"{'configuration':<41} {'trainable':>10} {'host GiB':>9} {'fits':>5} "
        f"{'GPU GiB':>8} {'fits':>5} " + (f"{'disk GiB':>9} {'fits':>5} " if disk else "")
        + f"{'tokens/s':>9}  bound by",
    ]
    for e in estimates:
        on_disk = (f"{_gib(e.disk):>9} {'yes' if e.fits_disk else 'NO':>5} " if e.method.on_disk
                   else f"{'-':>9} {'':>5} ") if disk else ""
        lines.append(f"{e.method.name:<41} {e.trainable / 1e9:>9.2f}B {_gib(e.host_total):>9} "
                     f"{'yes' if e.fits_host else 'NO':>5} {_gib(e.device_total):>8} "
                     f"{'yes' if e.fits_gpu else 'NO':>5} {on_disk}{e.tokens_per_s:>9,.0f}  "
                     f"{e.bound_by}")
    lines += ["", "host GiB = " + " + ".join(e0.host)]
    if disk:
        lines.append("host GiB, state on disk = " + " + ".join(disk[0].host))
        lines.append("disk GiB = optimizer copies + state (the floor without the model copy)")
    lines += ["GPU GiB (at the bound, not measured on a GPU) = " + " + ".join(e0.device),
              "tokens/s = tokens per step / the largest of: "
              + ", ".join((disk[0] if disk else e0).seconds)]
    return "\n".join(lines)


DOCS_MODELS = ("llama2-7b", "qwen2.5-14b", "qwen2.5-32b", "llama3-70b")
DOCS_HOSTS = (64, 128, 256)


def docs_table(w: Workload = Workload(), machine: Machine = Machine()) -> str:
    """The markdown table of docs/sizing.md: :data:`DOCS_MODELS` on a 24 GiB GPU with
    :data:`DOCS_HOSTS` GiB of host RAM, the other figures at their defaults."""
    rows = ["| model | configuration | host GiB | " + " | ".join(f"{h} GiB RAM" for h in DOCS_HOSTS)
            + " | GPU GiB | s/step: GPU | PCIe | host step | tokens/s bound |",
            "|---|---|---:|" + ":---:|" * len(DOCS_HOSTS) + "---:|---:|---:|---:|---:|"]
    for model in DOCS_MODELS:
        g, estimates = size(model, machine, w)
        for e in estimates:
            fits = ["yes" if e.host_total <= h * GIB else "no" for h in DOCS_HOSTS]
            t = e.seconds
            rows.append(f"| {g.name.split(' (')[0]} | {e.method.name} | {_gib(e.host_total)} | "
                        + " | ".join(fits) + f" | {_gib(e.device_total)} | "
                        f"{t['GPU compute']:.1f} | {t['PCIe']:.1f} | "
                        f"{t['host optimizer step']:.1f} | {e.tokens_per_s:,.0f} |")
    return "\n".join(rows)


def main(argv: Optional[list] = None) -> int:
    d, m = Workload(), Machine()
    ap = argparse.ArgumentParser(
        prog="python -m roundpipe.sizing", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("model", nargs="?", help="a built-in name (--list) or a folder/file "
                                             "holding a transformers config.json")
    ap.add_argument("--list", action="store_true", help="list the built-in geometries")
    ap.add_argument("--docs-table", action="store_true",
                    help="print docs/sizing.md's table (its models, 24 GB, 64/128/256 GB)")
    ap.add_argument("--docs-long-table", action="store_true",
                    help="print docs/sizing.md's long-sequence table (1.7B, 8B, 32B on 24 and "
                         "80 GB GPUs, 128 and 256 GB hosts)")
    ap.add_argument("--gpu", type=parse_bytes, default=f"{m.gpu_bytes / GIB:g}GB", metavar="SIZE",
                    help="GPU memory (24GB: an RTX 3090/4090)")
    ap.add_argument("--host", type=parse_bytes, default=f"{m.host_bytes / GIB:g}GB", metavar="SIZE",
                    help="host RAM")
    ap.add_argument("--host-reserve", type=parse_bytes, default=f"{m.host_reserve / GIB:g}GB", metavar="SIZE",
                    help="host RAM kept for the OS and the process's fixed costs (an allowance)")
    ap.add_argument("--fixed-device", type=parse_bytes, default=f"{m.fixed_device / GIB:g}GB", metavar="SIZE",
                    help="device memory besides the pipeline's bound: CUDA context, cuBLAS "
                         "workspaces, allocator slack (an allowance)")
    ap.add_argument("--pcie-gbps", type=float, default=m.pcie_gbps,
                    help="host<->GPU GB/s per direction: PCIe 4.0 x16 (a 24 GB card's bus) is "
                         "32 GB/s nominal; pinned copies reach about 25 in practice (on an "
                         "H200's PCIe 5.0 host, 55 GB/s pinned, our uploads 31-42)")
    ap.add_argument("--host-gbps", type=float, default=m.host_gbps,
                    help="host memory bandwidth of the optimizer step: 62 GB/s is fp32 AdamW "
                         "measured on a 16-core Xeon GPU host (1.82B parameters in 0.82 s)")
    ap.add_argument("--disk", type=parse_bytes, default=None, metavar="SIZE",
                    help="a local disk (NVMe) for the optimizer state: adds the configurations "
                         "with their optimizer copies and state on it (optimizer_dir)")
    ap.add_argument("--disk-gbps", type=float, default=m.disk_gbps,
                    help="the disk's sequential GB/s for a step's mix of reads and writes (7: a "
                         "PCIe 4.0 NVMe SSD's reads; measure yours with python -m "
                         "roundpipe.bench disk)")
    ap.add_argument("--gpu-tflops", type=float, default=m.gpu_tflops,
                    help="achieved bf16 TFLOPS: about half an RTX 4090's 165 TFLOPS dense "
                         "peak (fp32 accumulate); plain HF training reached 355 on an H200")
    for name, help_ in (("batch", "sequences per forward_backward call"),
                        ("seq", "tokens per sequence"),
                        ("microbatches", "microbatches per call"),
                        ("accumulation", "calls per optimizer step"),
                        ("lora-rank", "LoRA rank (on every linear of the decoder layers)"),
                        ("loss-chunk", "loss_chunk_size: tokens per chunk of the loss"),
                        ("layers-per-stage", "pipeline layers per stage: 1 is the wrapper's "
                                             "default; a stage planner packing more per stage "
                                             "raises the device bound")):
        ap.add_argument(f"--{name}", type=int, default=getattr(d, name.replace("-", "_")),
                        help=help_)
    args = ap.parse_args(argv)
    w = Workload(args.batch, args.seq, args.microbatches, args.accumulation, args.lora_rank,
                 args.loss_chunk, args.layers_per_stage)
    machine = Machine(args.gpu, args.host, args.host_reserve, args.pcie_gbps, args.host_gbps,
                      args.gpu_tflops, args.fixed_device, args.disk or 0.0, args.disk_gbps)
    try:
        if args.list:
            for key, (title, config) in BUILTIN.items():
                g = Geometry.from_config(config, title)
                print(f"{key:<12} {title:<16} {g.params() / 1e9:6.2f}B parameters")
            return 0
        if args.docs_table:
            print(docs_table(w, machine))
            return 0
        if args.docs_long_table:
            print(long_table(w, machine))
            return 0
        if args.model is None:
            ap.error("give a model (a built-in name, see --list, or a config.json)")
        g, estimates = size(args.model, machine, w)
        print(report(g, estimates))
        print()
        print(longest_report(g, machine, w))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
