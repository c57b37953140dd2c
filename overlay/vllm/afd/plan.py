# SPDX-License-Identifier: Apache-2.0
"""Decode planner for AFD: the attention:FFN ratio, batch and micro-batches from a roofline.

    python -m vllm.afd.plan --model deepseek-v3 --card h200 --gpus 8,16,32 --tpot-ms 50 \\
        --context 4096
    python -m vllm.afd.plan --model CONFIG_DIR --card h100 --calibration moe_crossover.json \\
        --calibration handover.json --gpus 2,4,8 --tpot-ms 30 --context 1024:0.7,8192:0.3
    python -m vllm.afd.plan check benchmarks/plan_figures.json   # predicted vs measured

Pure Python (no torch, no vLLM import): it reads a model's HF ``config.json`` (or a preset
name: ``PRESETS``), a card's specification (``CARDS`` or flags) and a decode workload (a
TPOT target, a context length mix) and searches, for each GPU count, the best

* AFD deployment: A attention GPUs (data parallel, each with batch b and its KV cache), F =
  N - A FFN GPUs (the routed experts split over them, the dense MLPs, shared experts and
  router replicated), m micro-batches per step (m = 1: the serial AFD this project runs;
  m >= 2: ping-pong, each micro-batch's attention overlapping another's FFN);
* colocated deployment on the same N GPUs: data-parallel attention and expert parallelism
  over all N (every GPU holds the attention and 1/N of the experts), without or with a
  two-micro-batch overlap of the all-to-all (m = 2);

and prints the predicted tokens/s per GPU of both under the TPOT target.

The cost model (docs/planner.md has the derivation and its error):

* every piece of work is (bytes, GEMM FLOPs, attention FLOPs) and takes
  ``max(bytes / (HBM bandwidth x mem_eff), FLOPs / (peak x flop_eff))`` on one GPU;
  weights are read once per pass (per micro-batch), the KV cache once per step; a batch of
  T tokens touches ``E (1 - (1 - k/E)^T)`` experts (uniform routing);
* a hand-over (attention <-> FFN, or the all-to-all of expert parallelism) costs its
  latency plus its bytes over the link (NVLink inside a host, the NIC between hosts);
* an AFD layer with m micro-batches takes ``max(m ta, m tf, m tlink, ta + tf + 2 tc)``
  (the attention GPU's work, the FFN GPU's, the link's, and one micro-batch's round trip);
  a step is ``layers x that + the LM head + a fixed overhead``;
* memory: weights + KV cache (at the mean context) + a reserve must fit each GPU.

The efficiencies and overheads (``Calibration``) default to values measured on an H200 by
this project's benchmarks; ``--calibration FILE`` reads this card's own (the JSON of
``benchmarks/moe_crossover.py`` or ``benchmarks/handover.py``, or a JSON of the fields).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# ------------------------------------------------------------------------------- cards


@dataclass(frozen=True)
class Card:
    """One GPU's specification (vendor figures): HBM bandwidth (TB/s), dense matrix peaks
    (TFLOP/s), memory (GB, 1e9 bytes), link bandwidth per GPU and direction (GB/s) inside a
    host (NVLink) and between hosts (the GPU's NIC), and the links' latency (us)."""

    name: str
    hbm_tbs: float
    bf16_tflops: float
    fp8_tflops: float
    memory_gb: float
    nvlink_gbs: float
    net_gbs: float
    nvlink_latency_us: float = 5.0
    net_latency_us: float = 10.0
    gpus_per_host: int = 8


# Spec sheet figures (SXM boards; dense, without sparsity). Link latencies are assumptions:
# 5 us is what one cuda_ipc hand-over took on one H200 (benchmarks/handover.py).
CARDS: dict[str, Card] = {
    "h100": Card("NVIDIA H100 SXM", 3.35, 989.0, 1979.0, 80.0, 450.0, 50.0),
    "h200": Card("NVIDIA H200", 4.8, 989.0, 1979.0, 141.0, 450.0, 50.0),
    "h800": Card("NVIDIA H800 SXM", 3.35, 989.0, 1979.0, 80.0, 200.0, 50.0),
    "h20": Card("NVIDIA H20", 4.0, 148.0, 296.0, 96.0, 450.0, 50.0),
    "a100": Card("NVIDIA A100 SXM 80GB", 2.039, 312.0, 312.0, 80.0, 300.0, 25.0),
}


def card_for_device(device_name: str) -> str | None:
    """The ``CARDS`` key of a CUDA device name (``torch.cuda.get_device_name()``), None
    for a device the table does not hold (PCIe and NVL boards have other figures)."""
    name = device_name.upper()
    if any(s in name for s in ("PCIE", "NVL")):
        return None
    for key in ("H200", "H800", "H100", "A100"):  # H200 before H20: "H200" contains "H20"
        if key in name:
            return key.lower()
    if "H20" in name:
        return "h20"
    return None


# ------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Model:
    """What a decode step reads and computes, from a model's config. ``moe_layers`` of the
    ``layers`` have routed experts, the others a dense MLP. Attention: ``mla`` (latent KV of
    ``kv_lora_rank + rope_dim`` a token and layer) or grouped-query (``2 kv_heads head_dim``),
    with an optional low-rank query (``q_lora_rank``). Sizes in parameters; bytes per
    weight, KV element and activation element on the wire."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    vocab: int
    dense_intermediate: int
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    tied_embeddings: bool = False
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def attention_params(self) -> int:
        """Attention projection weights of one layer."""
        h, n = self.hidden, self.heads
        if self.mla:
            qk = self.nope_dim + self.rope_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * n * qk) if self.q_lora_rank \
                else h * n * qk
            return (q + h * (self.kv_lora_rank + self.rope_dim)
                    + self.kv_lora_rank * n * (self.nope_dim + self.head_dim)
                    + n * self.head_dim * h)
        d = self.head_dim
        q = (h * self.q_lora_rank + self.q_lora_rank * n * d) if self.q_lora_rank else h * n * d
        return q + 2 * h * self.kv_heads * d + n * d * h

    @property
    def kv_elems(self) -> int:
        """KV cache elements of one token in one layer."""
        if self.mla:
            return self.kv_lora_rank + self.rope_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def attn_flops_per_context_token(self) -> int:
        """Scores and values of one query token against one cached token, one layer (MLA in
        the absorbed form vLLM decodes with: every head attends over the latent)."""
        if self.mla:
            return 2 * self.heads * (2 * self.kv_lora_rank + self.rope_dim)
        return 4 * self.heads * self.head_dim

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden * self.shared_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def head_params(self) -> int:
        """The LM head, read whole every step."""
        return self.hidden * self.vocab

    def attention_weight_bytes(self) -> float:
        """What an attention GPU holds: every layer's attention, the embedding and head."""
        emb = self.hidden * self.vocab * (1 if self.tied_embeddings else 2)
        return (self.layers * self.attention_params + emb) * self.weight_bytes

    def ffn_weight_bytes(self, ep: int = 1) -> float:
        """What one of ``ep`` FFN (expert-parallel) GPUs holds: its share of the routed
        experts (rounded up), the shared experts, routers and dense MLPs whole."""
        local = math.ceil(self.experts / ep) if self.experts else 0
        moe = self.moe_layers * (local * self.expert_params + self.shared_params
                                 + self.router_params)
        return (moe + self.dense_layers * self.dense_mlp_params) * self.weight_bytes

    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_elems * self.kv_bytes

    def total_params(self) -> int:
        return int((self.attention_weight_bytes() + self.ffn_weight_bytes()) / self.weight_bytes)

    def active_params(self) -> int:
        """Parameters a token uses (attention, its k experts, shared experts, dense MLPs,
        head)."""
        return (self.layers * self.attention_params + self.head_params
                + self.moe_layers * (self.top_k * self.expert_params + self.shared_params
                                     + self.router_params)
                + self.dense_layers * self.dense_mlp_params)

    @classmethod
    def from_hf_config(cls, cfg: dict, *, name: str | None = None, layers: int | None = None,
                       weight_bytes: float | None = None,
                       kv_bytes: float | None = None) -> Model:
        """A model from a HF ``config.json`` dict (DeepSeek-V2/V3, GLM-4 MoE, Qwen2/3-MoE,
        Mixtral, OLMoE, MiniMax-M2, GPT-OSS, Ernie-4.5 MoE, Llama 4, Step-3; dense models
        too). ``layers`` keeps the first N layers (a benchmark's cut-down model)."""
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items()
                                            if k in ("quantization_config",)}}
        g = cfg.get
        mt = str(g("model_type", ""))
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if g(key) is None:
                raise ValueError(f"config ({mt or 'no model_type'}) has no {key!r}")
        n_layers = int(layers or g("num_hidden_layers"))
        if layers and layers > int(g("num_hidden_layers")):
            raise ValueError(f"layers {layers} > the config's {g('num_hidden_layers')}")
        hidden, heads = int(g("hidden_size")), int(g("num_attention_heads"))
        experts = int(_first(cfg, "n_routed_experts", "num_local_experts", "num_experts",
                             "moe_num_experts") or 0)
        top_k = int(_first(cfg, "num_experts_per_tok", "moe_top_k", "moe_k") or 0)
        if experts and not top_k:
            raise ValueError(f"config ({mt}) has {experts} experts but no top-k key")
        per_expert_in_intermediate = mt in ("mixtral", "olmoe", "minimax_m2", "gpt_oss",
                                            "llama4_text", "llama4")
        inter = int(g("intermediate_size") or 0)
        if per_expert_in_intermediate or g("moe_intermediate_size") is None:
            expert_i = inter
        else:
            expert_i = int(g("moe_intermediate_size"))
        dense_i = int(g("intermediate_size_mlp") or inter) if mt.startswith("llama4") else inter
        shared_i = 0
        if g("n_shared_experts"):
            shared_i = int(g("n_shared_experts")) * expert_i
        elif g("shared_expert_intermediate_size"):
            shared_i = int(g("shared_expert_intermediate_size"))
        elif g("share_expert_dim"):
            shared_i = int(g("share_expert_dim"))
        elif g("moe_num_shared_experts"):
            shared_i = int(g("moe_num_shared_experts")) * expert_i
        elif mt.startswith("llama4") and experts:
            shared_i = expert_i
        moe_layers = sum(_is_moe_layer(cfg, mt, i, experts) for i in range(n_layers))
        if g("kv_lora_rank"):
            attn = dict(mla=True, kv_heads=heads, head_dim=int(g("v_head_dim")),
                        q_lora_rank=int(g("q_lora_rank") or 0),
                        kv_lora_rank=int(g("kv_lora_rank")),
                        rope_dim=int(g("qk_rope_head_dim")), nope_dim=int(g("qk_nope_head_dim")))
        elif mt == "step3_text":
            attn = dict(kv_heads=int(g("num_attention_groups") or 1),
                        head_dim=int(g("head_dim")), q_lora_rank=int(g("share_q_dim") or 0))
        else:
            attn = dict(kv_heads=int(g("num_key_value_heads") or heads),
                        head_dim=int(g("head_dim") or hidden // heads))
        wb = weight_bytes if weight_bytes is not None else _weight_bytes(cfg)
        kvb = kv_bytes if kv_bytes is not None else (2.0 if wb < 2 else wb)
        return cls(name=name or mt or "model", layers=n_layers, moe_layers=moe_layers,
                   hidden=hidden, vocab=int(g("vocab_size")), dense_intermediate=dense_i,
                   experts=experts, top_k=top_k, expert_intermediate=expert_i,
                   shared_intermediate=shared_i, heads=heads,
                   tied_embeddings=bool(g("tie_word_embeddings", False)), weight_bytes=wb,
                   kv_bytes=kvb, act_bytes=2.0 if wb < 2 else wb, **attn)


def _first(cfg: dict, *keys: str):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _is_moe_layer(cfg: dict, mt: str, i: int, experts: int) -> bool:
    """Whether layer ``i`` has routed experts, by the family's own keys."""
    g = cfg.get
    if not experts:
        return False
    if g("moe_layers_enum") is not None:  # Step-3
        enum = g("moe_layers_enum")
        ids = [int(x) for x in enum.split(",")] if isinstance(enum, str) else list(enum)
        return i in ids
    if g("first_k_dense_replace") is not None:  # DeepSeek, GLM-4 MoE
        return i >= int(g("first_k_dense_replace")) and i % int(g("moe_layer_freq") or 1) == 0
    if g("moe_layer_start_index") is not None:  # Ernie-4.5
        end = g("moe_layer_end_index")
        end = int(end) if end is not None and int(end) >= 0 else 1 << 30
        return (int(g("moe_layer_start_index")) <= i <= end
                and (i - int(g("moe_layer_start_index"))) % int(g("moe_layer_interval") or 1) == 0)
    if mt.startswith("llama4"):
        return (i + 1) % int(g("interleave_moe_layer_step") or 1) == 0
    if g("decoder_sparse_step") is not None or g("mlp_only_layers") is not None:  # Qwen
        step = int(g("decoder_sparse_step") or 1)
        return i not in (g("mlp_only_layers") or []) and (i + 1) % step == 0
    return True


def _weight_bytes(cfg: dict) -> float:
    q = cfg.get("quantization_config") or {}
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8":
        return 1.0
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return 4.0 if "32" in dtype else 2.0


# Published shapes (HF config keys) for the planner's validation and predictions.
PRESETS: dict[str, dict] = {
    "deepseek-v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
        "quantization_config": {"quant_method": "fp8"}, "torch_dtype": "bfloat16",
    },
    # benchmarks/make_shape.py's preset of the same name
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
        "torch_dtype": "bfloat16",
    },
    # Step-3's text model (vLLM's Step3TextConfig defaults: layers 4-59 MoE)
    "step3": {
        "model_type": "step3_text", "num_hidden_layers": 61, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 5120, "moe_num_experts": 48,
        "moe_top_k": 3, "share_expert_dim": 5120, "share_q_dim": 2048, "head_dim": 256,
        "num_attention_heads": 64, "num_attention_groups": 1, "vocab_size": 128815,
        "moe_layers_enum": list(range(4, 60)),
        "quantization_config": {"quant_method": "fp8"}, "torch_dtype": "bfloat16",
    },
    "mixtral-8x22b": {
        "model_type": "mixtral", "num_hidden_layers": 56, "hidden_size": 6144,
        "intermediate_size": 16384, "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 32768, "torch_dtype": "bfloat16",
    },
}


def load_model(spec: str, *, layers: int | None = None, weight_bytes: float | None = None,
               kv_bytes: float | None = None, overrides: dict | None = None) -> Model:
    """A preset name, a config.json file or a directory holding one."""
    if spec in PRESETS:
        cfg, name = dict(PRESETS[spec]), spec
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--model {spec}: not a preset ({', '.join(sorted(PRESETS))}) "
                             "nor a config.json or a directory holding one")
        cfg, name = json.loads(path.read_text()), path.parent.name
    cfg.update(overrides or {})
    return Model.from_hf_config(cfg, name=name, layers=layers, weight_bytes=weight_bytes,
                                kv_bytes=kv_bytes)


# -------------------------------------------------------------------- work of a step


@dataclass(frozen=True)
class Work:
    """Bytes through HBM, weight-GEMM FLOPs and attention FLOPs."""

    bytes: float = 0.0
    gemm_flops: float = 0.0
    attn_flops: float = 0.0

    def __add__(self, o: Work) -> Work:
        return Work(self.bytes + o.bytes, self.gemm_flops + o.gemm_flops,
                    self.attn_flops + o.attn_flops)

    def __mul__(self, k: float) -> Work:
        return Work(self.bytes * k, self.gemm_flops * k, self.attn_flops * k)

    __rmul__ = __mul__


ROUTINGS = ("uniform", "balanced", "collapsed")


def active_experts(tokens: float, experts: int, top_k: int, routing: str = "uniform") -> float:
    """Experts that ``tokens`` tokens touch, each choosing ``top_k`` distinct ones: at random
    (``uniform``, a trained router's decode batch is close to it), round-robin
    (``balanced``, the benchmarks' afd_balanced) or all the same (``collapsed``)."""
    if not experts or tokens <= 0:
        return 0.0
    if routing == "uniform":
        return experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    if routing == "balanced":
        return float(min(experts, math.ceil(tokens * top_k)))
    if routing == "collapsed":
        return float(top_k)
    raise ValueError(f"unknown routing {routing!r}: one of {ROUTINGS}")


def attention_layers_work(m: Model, seqs: float, context: float) -> Work:
    """Every layer's attention for ``seqs`` sequences of mean ``context`` cached tokens:
    the projection weights (once), the KV cache, the layer's input and output."""
    if seqs <= 0:
        return Work()
    weights = m.layers * m.attention_params * m.weight_bytes
    kv = seqs * context * m.kv_bytes_per_token()
    acts = seqs * m.layers * 2 * m.hidden * m.act_bytes
    return Work(weights + kv + acts, 2.0 * seqs * m.layers * m.attention_params,
                seqs * context * m.layers * m.attn_flops_per_context_token)


def head_work(m: Model, seqs: float) -> Work:
    """The LM head (read whole) and the embedding rows of ``seqs`` sequences."""
    if seqs <= 0:
        return Work()
    return Work((m.head_params + seqs * (m.hidden + m.vocab)) * m.weight_bytes,
                2.0 * seqs * m.head_params)


def ffn_work(m: Model, tokens: float, ep: int = 1, routing: str = "uniform") -> Work:
    """Every layer's MLP for ``tokens`` tokens on one of ``ep`` FFN GPUs: its share of the
    routed experts (their pairs, the experts they touch), and the replicated part (shared
    experts, router, dense MLPs: held whole, run on tokens / ep). One MoE layer alone:
    ``moe_layer_work``."""
    if tokens <= 0:
        return Work()
    return (m.moe_layers * moe_layer_work(m, tokens, ep, routing)
            + m.dense_layers * dense_layer_work(m, tokens / ep))


def moe_layer_work(m: Model, tokens: float, ep: int = 1, routing: str = "uniform") -> Work:
    """One MoE layer (routed experts, shared experts, router) on one of ``ep`` GPUs: the
    experts touched read once, activations in and out, the experts' intermediates."""
    wb, ab, h = m.weight_bytes, m.act_bytes, m.hidden
    collapsed = routing == "collapsed"
    active = active_experts(tokens, m.experts, m.top_k, routing) / (1 if collapsed else ep)
    pairs = tokens * m.top_k / (1 if collapsed else ep)
    own = tokens / ep
    weights = (active * m.expert_params + m.shared_params + m.router_params) * wb
    acts = (2 * own * h + pairs * (2 * h + 3 * m.expert_intermediate)
            + own * 3 * m.shared_intermediate) * ab
    gemm = 2.0 * (pairs * m.expert_params + own * (m.shared_params + m.router_params))
    return Work(weights + acts, gemm)


def dense_layer_work(m: Model, tokens: float) -> Work:
    return Work(m.dense_mlp_params * m.weight_bytes + tokens * 2 * m.hidden * m.act_bytes,
                2.0 * tokens * m.dense_mlp_params)


def engine_work(m: Model, seqs: float, context: float, routing: str = "uniform") -> Work:
    """One plain engine's decode step on one GPU."""
    return (attention_layers_work(m, seqs, context) + head_work(m, seqs)
            + ffn_work(m, seqs, 1, routing))


# ------------------------------------------------------------------------ calibration


@dataclass(frozen=True)
class Calibration:
    """What a card reaches of its specification, and the fixed costs the bytes and FLOPs do
    not count. ``mem_eff``/``flop_eff``: achieved fraction of the HBM bandwidth / matrix
    peak by weight- and KV-streaming kernels; ``step_overhead_us``: per decode step
    (scheduling, launches outside the layers); ``token_overhead_us``: per sequence and
    step (sampling, logits, the host's per-request work); ``layer_overhead_us``: per layer
    and pass of each role; ``overlap_p``: how a kernel's memory and compute times combine,
    ``(m^p + c^p)^(1/p)`` (infinite: the roofline's max; a fused MoE kernel near the
    crossover takes longer than either alone); ``handover_us``: one hand-over between two processes on one host
    (its latency, without the bytes); ``shared_mem_eff``: the bandwidth fraction several
    processes reach together on one GPU."""

    mem_eff: float = 1.0
    flop_eff: float = 1.0
    step_overhead_us: float = 0.0
    layer_overhead_us: float = 0.0
    handover_us: float = 0.0
    shared_mem_eff: float | None = None
    token_overhead_us: float = 0.0
    overlap_p: float = math.inf
    sources: tuple[str, ...] = ()

    def overhead_s(self, layers: int, seqs: float) -> float:
        """The fixed part of one engine's step of ``seqs`` sequences."""
        return (self.step_overhead_us + layers * self.layer_overhead_us
                + seqs * self.token_overhead_us) * 1e-6

    @property
    def concurrent_mem_eff(self) -> float:
        """Bandwidth fraction when several processes stream at once on one GPU (CUDA MPS:
        one's kernels fill the others' gaps); ``mem_eff`` unless calibrated."""
        return self.shared_mem_eff if self.shared_mem_eff is not None else self.mem_eff


# The bounds: the card's specification, nothing else.
ROOFLINE = Calibration(sources=("spec sheet",))
# Measured by this project's benchmarks on one H200 on 2026-12-06 (the calibration
# "h200-2026-12-06" that `python -m vllm.afd.plan check benchmarks/plan_figures.json`
# derives): DeepSeek-V2-Lite's fused MoE layer streamed its experts at 70% of the 4.8 TB/s
# and computed at 48% of the bf16 peak, the two combining as a 2-norm (moe_crossover.py);
# one cuda_ipc hand-over took 4.84 us (handover.py); one plain engine at batch 32 and 512
# left 288 us plus 3.9 us a sequence over its bytes, two replicas at once streamed at 77%
# (decode.py).
H200_MEASURED = Calibration(mem_eff=0.704, flop_eff=0.481, overlap_p=2.0,
                            step_overhead_us=288.5, token_overhead_us=3.89, handover_us=4.84,
                            shared_mem_eff=0.771,
                            sources=("H200 measurements, benchmarks/plan_figures.json",))


def seconds(work: Work, card: Card, cal: Calibration, weight_bytes: float = 2.0) -> float:
    """The time of ``work`` on one GPU: its bytes over the bandwidth and its FLOPs over the
    matrix peak (weight GEMMs at the weights' precision, attention in bf16), combined as
    the larger of the two (the roofline) or, calibrated, their ``overlap_p``-norm."""
    return combine(memory_seconds(work, card, cal),
                   compute_seconds(work, card, cal, weight_bytes), cal.overlap_p)


def combine(mem: float, comp: float, p: float = math.inf) -> float:
    """``(mem^p + comp^p)^(1/p)``: the larger of the two for an infinite ``p``."""
    if math.isinf(p):
        return max(mem, comp)
    top = max(mem, comp)
    if top <= 0:
        return 0.0
    return top * ((mem / top) ** p + (comp / top) ** p) ** (1.0 / p)


def memory_seconds(work: Work, card: Card, cal: Calibration) -> float:
    return work.bytes / (card.hbm_tbs * 1e12 * cal.mem_eff)


def compute_seconds(work: Work, card: Card, cal: Calibration,
                    weight_bytes: float = 2.0) -> float:
    gemm = card.fp8_tflops if weight_bytes <= 1 else card.bf16_tflops
    return (work.gemm_flops / (gemm * 1e12 * cal.flop_eff)
            + work.attn_flops / (card.bf16_tflops * 1e12 * cal.flop_eff))


OVERLAP_PS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, math.inf)


def fit_moe_layer(m: Model, card: Card, points: Iterable[tuple[float, float]],
                  routing: str = "uniform", ep: int = 1) -> tuple[float, float, float]:
    """(mem_eff, flop_eff, overlap_p) from one MoE layer's measured times ``(tokens,
    us)``. For each ``p`` of ``OVERLAP_PS``, ``t^p = (bytes / bw')^p + (flops / peak')^p``
    is linear in ``bw'^-p`` and ``peak'^-p``: a least-squares fit of the relative error
    gives the two rates; the ``p`` of the smallest error wins (p infinite: the best
    bandwidth and FLOP rate any point reached, the roofline's max touching the most
    efficient points). The rates come back as fractions of the card's."""
    rate = (card.fp8_tflops if m.weight_bytes <= 1 else card.bf16_tflops) * 1e12
    bw = card.hbm_tbs * 1e12
    pts = []
    for tokens, us in points:
        w = moe_layer_work(m, tokens, ep, routing)
        pts.append((w.bytes, w.gemm_flops, us * 1e-6))
    if not pts:
        raise ValueError("no MoE layer time to calibrate on")
    best = None
    for p in reversed(OVERLAP_PS):  # the roofline's max first: it stays unless beaten
        fit = _fit_rates(pts, p)
        if fit is None:
            continue
        mem_rate, flop_rate = fit
        err = sum((combine(b / mem_rate, f / flop_rate, p) / t - 1) ** 2 for b, f, t in pts)
        if best is None or err < best[0] - 1e-9:
            best = (err, mem_rate, flop_rate, p)
    _, mem_rate, flop_rate, p = best
    return min(mem_rate / bw, 1.0), min(flop_rate / rate, 1.0), p


def _fit_rates(pts: list[tuple[float, float, float]], p: float) -> tuple[float, float] | None:
    """(bytes/s, FLOP/s) of ``t = ((B/bw)^p + (F/peak)^p)^(1/p)`` over ``pts`` (B, F, t),
    None where the fit has no positive solution."""
    if math.isinf(p):
        return max(b / t for b, _, t in pts), max(f / t for _, f, t in pts)
    # Weighted least squares of t^p = x B^p + y F^p, weights 1/t^p (relative error).
    rows = [((b ** p) / t ** p, (f ** p) / t ** p) for b, f, t in pts]
    s11 = sum(u * u for u, _ in rows)
    s12 = sum(u * v for u, v in rows)
    s22 = sum(v * v for _, v in rows)
    r1 = sum(u for u, _ in rows)
    r2 = sum(v for _, v in rows)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return None
    x = (r1 * s22 - r2 * s12) / det
    y = (s11 * r2 - s12 * r1) / det
    if x <= 0 or y <= 0:
        return None
    return x ** (-1.0 / p), y ** (-1.0 / p)


def fit_step_overhead(m: Model, card: Card, cal: Calibration,
                      points: Sequence[tuple[int, float, float]],
                      routing: str = "uniform") -> tuple[float, float]:
    """(step_overhead_us, token_overhead_us) from one plain engine's measured steps
    ``(batch, context, tpot_s)``: what the TPOT leaves over the time of its bytes and FLOPs
    at ``cal``'s efficiencies, as a fixed part and a part per sequence (a least-squares
    line through two or more batches; one point gives the fixed part alone). Neither is
    negative."""
    res = []
    for batch, context, tpot_s in points:
        t = seconds(engine_work(m, batch, context, routing), card, cal, m.weight_bytes)
        res.append((batch, (tpot_s - t - m.layers * cal.layer_overhead_us * 1e-6) * 1e6))
    if not res:
        raise ValueError("no plain step to fit the overhead on")
    if len({b for b, _ in res}) < 2:
        return max(0.0, statistics.fmean(r for _, r in res)), 0.0
    mb = statistics.fmean(b for b, _ in res)
    mr = statistics.fmean(r for _, r in res)
    slope = (sum((b - mb) * (r - mr) for b, r in res) / sum((b - mb) ** 2 for b, _ in res))
    slope = max(0.0, slope)
    return max(0.0, mr - slope * mb), slope


def fit_shared_mem_eff(m: Model, card: Card, cal: Calibration, engines: int, batch: int,
                       context: float, tpot_s: float, routing: str = "uniform") -> float:
    """The bandwidth fraction ``engines`` plain replicas on one GPU reached together: their
    bytes over the measured step less the fixed overhead."""
    w = engines * engine_work(m, batch, context, routing)
    t = tpot_s - cal.overhead_s(m.layers, batch)
    comp = compute_seconds(w, card, cal, m.weight_bytes)
    if t <= comp:
        raise ValueError("the replicas' step is shorter than its fixed overhead and FLOPs")
    p = cal.overlap_p
    mem = t if math.isinf(p) else (t ** p - comp ** p) ** (1.0 / p)
    return min(1.0, w.bytes / mem / (card.hbm_tbs * 1e12))


def calibration_from_json(data: dict, card: Card, cal: Calibration,
                          source: str = "json") -> Calibration:
    """Read one calibration JSON: ``benchmarks/moe_crossover.py --json`` (measured rows:
    the MoE layer's bandwidth and FLOP rate), ``benchmarks/handover.py --json`` (us per
    hand-over, the connector's split kernels), or an object of ``Calibration``'s fields."""
    if isinstance(data.get("rows"), list) and "moe_intermediate" in data:
        pts = [(r["tokens"], r["layer_us"]) for r in data["rows"] if "layer_us" in r]
        if not pts:
            raise ValueError(f"{source}: moe_crossover JSON without measured rows "
                             "(an --analytic run)")
        shape = Model(name="moe layer", layers=1, moe_layers=1, hidden=data["hidden"],
                      vocab=0, dense_intermediate=0, experts=data["experts"],
                      top_k=data["top_k"], expert_intermediate=data["moe_intermediate"],
                      shared_intermediate=data["shared"] * data["moe_intermediate"], heads=1,
                      kv_heads=1, head_dim=1,
                      weight_bytes={"float32": 4.0}.get(data.get("dtype"), 2.0),
                      act_bytes={"float32": 4.0}.get(data.get("dtype"), 2.0))
        mem, flop, p = fit_moe_layer(shape, card, pts, data.get("routing", "uniform"),
                                     int(data.get("ep", 1)))
        return replace(cal, mem_eff=mem, flop_eff=flop, overlap_p=p,
                       sources=(*cal.sources, source))
    if "sharing" in data and isinstance(data.get("results"), dict):
        layers = int(data.get("args", {}).get("layers", 27))
        per = [r["step_us"] / (2 * layers)
               for key, r in data["results"].get("attention", {}).items()
               if key.startswith("split/")]
        if not per:
            raise ValueError(f"{source}: handover JSON without split-kernel results")
        return replace(cal, handover_us=statistics.median(per), sources=(*cal.sources, source))
    known = {f for f in Calibration.__dataclass_fields__ if f != "sources"}
    fields = {k: float(v) for k, v in data.items() if k in known}
    unknown = set(data) - known - {"card", "note"}
    if unknown or not fields:
        raise ValueError(f"{source}: not a moe_crossover or handover JSON, and keys "
                         f"{sorted(unknown) or '(none)'} are not calibration fields "
                         f"({', '.join(sorted(known))})")
    return replace(cal, **fields, sources=(*cal.sources, source))


# ------------------------------------------------------------------ one-GPU configurations

ONE_GPU_MODES = ("plain", "plain_one", "afd", "afd_pingpong")


def one_gpu_work(m: Model, mode: str, engines: int, batch: int, context: float,
                 routing: str = "uniform") -> dict[str, Work]:
    """The work of one decode step of a benchmark configuration, per role (``attention``,
    ``ffn``; ``plain`` for whole engines): ``plain`` is ``engines`` replicas of batch
    ``batch`` (each reads every weight), ``plain_one`` one engine of ``engines x batch``,
    ``afd`` ``engines`` attention ranks of ``batch`` and one FFN rank whose pass joins all
    their tokens; ``afd_pingpong`` the same ranks, the FFN rank serving each one's step in a
    pass of its own (connector_extra_config.ffn_schedule pingpong: every pass streams the
    experts its tokens touch again)."""
    if mode == "plain":
        return {"plain": engines * engine_work(m, batch, context, routing)}
    if mode == "plain_one":
        return {"plain": engine_work(m, engines * batch, context, routing)}
    if mode == "afd":
        att = engines * (attention_layers_work(m, batch, context) + head_work(m, batch))
        return {"attention": att, "ffn": ffn_work(m, engines * batch, 1, routing)}
    if mode == "afd_pingpong":
        att = engines * (attention_layers_work(m, batch, context) + head_work(m, batch))
        return {"attention": att, "ffn": engines * ffn_work(m, batch, 1, routing)}
    raise ValueError(f"unknown mode {mode!r}: one of {ONE_GPU_MODES}")


@dataclass(frozen=True)
class Bound:
    """The roofline of one decode step: its time at the card's specification (the larger
    of bytes over bandwidth and FLOPs over peak, on the busiest GPU), and the tokens/s that
    allows."""

    step_s: float
    memory_s: float
    compute_s: float
    bytes: float
    tokens: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def limit(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def step_bound(m: Model, card: Card, mode: str, engines: int, batch: int, context: float,
               routing: str = "uniform", same_gpu: bool = True,
               cal: Calibration = ROOFLINE) -> Bound:
    """The roofline of one benchmark configuration. ``same_gpu``: every role on one GPU
    (their bytes add up); else the AFD roles on two GPUs (the busier one bounds)."""
    works = one_gpu_work(m, mode, engines, batch, context, routing)
    gpus = [sum(works.values(), Work())] if same_gpu else list(works.values())
    per = [(memory_seconds(w, card, cal), compute_seconds(w, card, cal, m.weight_bytes), w)
           for w in gpus]
    mem, comp, w = max(per, key=lambda p: max(p[0], p[1]))
    return Bound(max(mem, comp), mem, comp, w.bytes, engines * batch)


def predict_one_gpu(m: Model, card: Card, cal: Calibration, mode: str, engines: int,
                    batch: int, context: float, routing: str = "uniform",
                    ffn_passes: float = 1.0) -> float:
    """Predicted TPOT (s) of a configuration with every process on one GPU under MPS: the
    step's work at the calibrated rates (the bytes of processes that stream at once - the
    replicas, the attention ranks - at ``concurrent_mem_eff``), the fixed step overhead
    (the engines run side by side), and for AFD two hand-overs a layer. ``ffn_passes``:
    AFD with several attention ranks, the FFN passes per step of every rank (1: every
    pass joined all ranks; ``engines``: none did), e.g. from decode.py's FFN counters
    (``passes_per_round``)."""
    if not 1.0 <= ffn_passes <= max(1, engines):
        raise ValueError(f"ffn_passes {ffn_passes} outside 1..{engines}")
    shared = replace(cal, mem_eff=cal.concurrent_mem_eff)
    if mode == "afd":
        att = engines * (attention_layers_work(m, batch, context) + head_work(m, batch))
        ffn = ffn_passes * ffn_work(m, engines * batch / ffn_passes, 1, routing)
        t = seconds(att, card, shared if engines > 1 else cal, m.weight_bytes)
        t += seconds(ffn, card, cal, m.weight_bytes)
        t += 2 * m.layers * cal.handover_us * 1e-6
    else:
        works = one_gpu_work(m, mode, engines, batch, context, routing)
        many = mode == "plain" and engines > 1
        t = seconds(sum(works.values(), Work()), card, shared if many else cal, m.weight_bytes)
    # Each engine's fixed part runs beside the others' (processes of their own).
    return t + cal.overhead_s(m.layers, engines * batch if mode == "plain_one" else batch)


def passes_per_round(engines: int, passes: int, joined: int) -> float:
    """FFN passes per step of every attention rank, from an FFN rank's counters (passes
    served, passes that joined several ranks), taking a joined pass as joining all
    ``engines`` ranks."""
    rank_steps = (passes - joined) + engines * joined
    if passes <= 0 or rank_steps <= 0:
        raise ValueError("no FFN passes counted")
    return min(float(engines), max(1.0, engines * passes / rank_steps))


# ---------------------------------------------------------------- multi-GPU deployments


@dataclass(frozen=True)
class Cluster:
    card: Card
    gpus_per_host: int = 8
    memory_util: float = 0.9  # of each GPU's memory for weights and KV cache
    reserve_gb: float = 4.0  # activations, graphs, buffers
    dispatch_bytes: float | None = None  # activation bytes sent to the FFN (None: act_bytes)

    def afd_link(self, gpus: int) -> tuple[float, float]:
        """(GB/s, latency us) of an AFD hand-over among ``gpus`` GPUs: NVLink when both
        roles fit one host, else the NIC (the roles on hosts of their own)."""
        c = self.card
        if gpus <= self.gpus_per_host:
            return c.nvlink_gbs, c.nvlink_latency_us
        return c.net_gbs, c.net_latency_us

    def all_to_all_seconds(self, nbytes: float, gpus: int) -> tuple[float, float]:
        """(bandwidth s, latency s) of one GPU sending ``nbytes`` spread evenly over the
        other ``gpus - 1`` GPUs: the share in its host over NVLink, the rest over the NIC,
        at once."""
        c = self.card
        if gpus <= 1:
            return 0.0, 0.0
        in_host = (min(gpus, self.gpus_per_host) - 1) / (gpus - 1)
        t = max(nbytes * in_host / (c.nvlink_gbs * 1e9),
                nbytes * (1 - in_host) / (c.net_gbs * 1e9))
        lat = c.nvlink_latency_us if gpus <= self.gpus_per_host else c.net_latency_us
        return t, lat * 1e-6

    def usable_bytes(self) -> float:
        return (self.card.memory_gb * self.memory_util - self.reserve_gb) * 1e9


@dataclass(frozen=True)
class Deployment:
    """One deployment's predicted decode step. ``batch``: sequences per group of ``tp``
    attention GPUs (AFD), per GPU (colocated DP+EP), per replica of ``tp`` GPUs (tensor
    parallel). Per layer and micro-batch: ``attention_s``, ``ffn_s``, ``link_s`` (one
    hand-over; tensor parallel: the layer's two all-reduces)."""

    kind: str
    gpus: int
    attention_gpus: int
    ffn_gpus: int
    batch: int
    micro_batches: int
    tpot_s: float
    attention_s: float
    ffn_s: float
    link_s: float
    attention_mem_gb: float
    ffn_mem_gb: float
    tp: int = 1

    @property
    def tok_s(self) -> float:
        return self.attention_gpus // self.tp * self.batch / self.tpot_s

    @property
    def tok_s_per_gpu(self) -> float:
        return self.tok_s / self.gpus

    @property
    def ratio(self) -> str:
        if self.kind == "afd":
            return f"{self.attention_gpus}:{self.ffn_gpus}" + (f" TP{self.tp}" if self.tp > 1
                                                              else "")
        return f"TP{self.tp}" if self.kind == "tp" else "-"

    @property
    def limiter(self) -> str:
        """The largest of the attention, FFN and link times of a layer."""
        parts = {"attention": self.attention_s, "FFN": self.ffn_s, "link": self.link_s}
        return max(parts, key=parts.get)


def _fanout(gpus: int, top_k: int) -> float:
    """Distinct GPUs among ``gpus`` that a token's ``top_k`` experts sit on (uniform)."""
    if gpus <= 1 or top_k <= 0:
        return 1.0
    return gpus * (1.0 - (1.0 - 1.0 / gpus) ** top_k)


def attention_gpu_work(m: Model, seqs: float, context: float, tp: int = 1) -> Work:
    """One GPU's share of every layer's attention for ``seqs`` sequences in a
    tensor-parallel group of ``tp``: 1/tp of the weights and FLOPs, the KV cache split with
    the KV heads (grouped-query: up to ``kv_heads`` ways; MLA's one latent: whole on every
    GPU)."""
    att = attention_layers_work(m, seqs, context)
    if tp == 1 or seqs <= 0:
        return att
    weights = m.layers * m.attention_params * m.weight_bytes
    kv = seqs * context * m.kv_bytes_per_token()
    share = 1.0 if m.mla else 1.0 / min(tp, m.kv_heads)
    return Work(weights / tp + kv * share + (att.bytes - weights - kv), att.gemm_flops / tp,
                att.attn_flops / tp)


def allreduce_seconds(cl: Cluster, cal: Calibration, tp: int, tokens: float,
                      hidden: int, nbytes: float) -> float:
    """One ring all-reduce of ``tokens`` hidden states in a group of ``tp`` GPUs of a host:
    its latency and 2 (tp - 1) / tp of the data over NVLink."""
    if tp <= 1:
        return 0.0
    moved = 2 * (tp - 1) / tp * tokens * hidden * nbytes
    return (max(cl.card.nvlink_latency_us, cal.handover_us) * 1e-6
            + moved / (cl.card.nvlink_gbs * 1e9))


def afd_deployment(m: Model, cl: Cluster, cal: Calibration, attention_gpus: int,
                   ffn_gpus: int, batch: int, micro_batches: int, context: float,
                   routing: str = "uniform", attention_tp: int = 1) -> Deployment:
    """AFD: ``attention_gpus`` attention GPUs, in groups of ``attention_tp`` (tensor
    parallel, one all-reduce a layer; 1: data parallel) of ``batch`` sequences each,
    ``ffn_gpus`` FFN GPUs (expert parallel), ``micro_batches`` per step (ping-pong for 2 or
    more)."""
    a, f, mb, t = attention_gpus, ffn_gpus, micro_batches, attention_tp
    if a % t:
        raise ValueError(f"{a} attention GPUs do not split into groups of {t}")
    groups = a // t
    card, L = cl.card, m.layers
    s = batch / mb
    ov = cal.layer_overhead_us * 1e-6
    ta = (seconds(attention_gpu_work(m, s, context, t) * (1 / L), card, cal, m.weight_bytes)
          + ov + allreduce_seconds(cl, cal, t, s, m.hidden, m.act_bytes))
    tf = seconds(ffn_work(m, groups * s, f, routing) * (1 / L), card, cal, m.weight_bytes) + ov
    gbs, lat = cl.afd_link(a + f)
    fan = _fanout(f, m.top_k) if m.experts else 1.0
    db = cl.dispatch_bytes or m.act_bytes
    # Dispatch: each attention GPU sends its 1/t of the group's micro-batch, each FFN GPU
    # receives its share of every group's. Combine: each FFN GPU returns its share to
    # every GPU of each group, each attention GPU receives the whole micro-batch's output.
    tok = s * fan * m.hidden
    dispatch = max(tok * db / t, groups * tok / f * db) / (gbs * 1e9)
    combine_ = max(groups * tok / f * t * m.act_bytes, tok * m.act_bytes) / (gbs * 1e9)
    t_bw = max(dispatch, combine_)  # one direction of a link, per micro-batch
    tc = max(lat * 1e-6, cal.handover_us * 1e-6) + t_bw
    cycle = max(mb * ta, mb * tf, mb * t_bw, ta + tf + 2 * tc)
    head = mb * seconds(head_work(m, s) * (1 / t), card, cal, m.weight_bytes)
    tpot = L * cycle + head + cal.overhead_s(0, batch)
    share = 1.0 if m.mla else 1.0 / min(t, m.kv_heads)
    att_mem = m.attention_weight_bytes() / t + batch * context * m.kv_bytes_per_token() * share
    return Deployment("afd", a + f, a, f, batch, mb, tpot, ta, tf, tc, att_mem / 1e9,
                      m.ffn_weight_bytes(f) / 1e9, t)


def colocated_deployment(m: Model, cl: Cluster, cal: Calibration, gpus: int, batch: int,
                         micro_batches: int, context: float,
                         routing: str = "uniform") -> Deployment:
    """Data-parallel attention and expert parallelism over ``gpus`` GPUs, ``batch``
    sequences each; ``micro_batches`` 2: two micro-batches whose all-to-all overlaps the
    other's compute (each reads the weights again)."""
    n, mb = gpus, micro_batches
    card, L = cl.card, m.layers
    s = batch / mb
    ov = cal.layer_overhead_us * 1e-6
    ta = seconds(attention_layers_work(m, s, context) * (1 / L), card, cal, m.weight_bytes) + ov
    tf = seconds(ffn_work(m, n * s, n, routing) * (1 / L), card, cal, m.weight_bytes) + ov
    if n > 1 and m.experts:
        fan = _fanout(n, m.top_k)
        db = cl.dispatch_bytes or m.act_bytes
        # Dispatch out of this GPU and the combine it sends back for the others' tokens.
        out = s * m.hidden * fan * (n - 1) / n * (db + m.act_bytes)
        t_bw, lat = cl.all_to_all_seconds(out, n)
        tc = 2 * max(lat, cal.handover_us * 1e-6) + t_bw
    else:
        t_bw = tc = 0.0
    cycle = max(mb * (ta + tf), mb * t_bw, ta + tf + tc)
    head = mb * seconds(head_work(m, s), card, cal, m.weight_bytes)
    tpot = L * cycle + head + cal.overhead_s(0, batch)
    mem = (m.attention_weight_bytes() + m.ffn_weight_bytes(n)
           + batch * context * m.kv_bytes_per_token())
    return Deployment("colocated", n, n, 0, batch, mb, tpot, ta, tf, tc, mem / 1e9, 0.0)


def tp_deployment(m: Model, cl: Cluster, cal: Calibration, gpus: int, tp: int, batch: int,
                  context: float, routing: str = "uniform") -> Deployment:
    """``gpus / tp`` replicas of tensor parallelism ``tp`` inside a host (vLLM's and
    TensorRT-LLM's usual deployment): every GPU holds 1/tp of every weight (each expert's
    matrices split), ``batch`` sequences a replica, two all-reduces of the hidden states a
    layer over NVLink. The KV cache splits with the KV heads (grouped-query: up to
    ``kv_heads`` ways; MLA's one latent: every GPU reads it whole)."""
    t, card, L = tp, cl.card, m.layers
    kv_share = 1.0 if m.mla else 1.0 / min(t, m.kv_heads)
    ov = cal.layer_overhead_us * 1e-6
    ta = seconds(attention_gpu_work(m, batch, context, t) * (1 / L), card, cal,
                 m.weight_bytes) + ov
    tf = seconds(ffn_work(m, batch, 1, routing) * (1 / (L * t)), card, cal, m.weight_bytes) + ov
    tc = 2 * allreduce_seconds(cl, cal, t, batch, m.hidden, m.act_bytes)
    head = seconds(head_work(m, batch) * (1 / t), card, cal, m.weight_bytes)
    tpot = L * (ta + tf + tc) + head + cal.overhead_s(0, batch)
    mem = ((m.attention_weight_bytes() + m.ffn_weight_bytes(1)) / t
           + batch * context * m.kv_bytes_per_token() * kv_share)
    return Deployment("tp", gpus, gpus, 0, batch, 1, tpot, ta, tf, tc, mem / 1e9, 0.0, t)


def batch_grid(limit: int = 16384) -> list[int]:
    """Batch sizes tried: every one to 16, then about 5% apart."""
    out, b = list(range(1, 17)), 16.0
    while b < limit:
        b *= 1.05
        out.append(int(round(b)))
    return sorted(set(x for x in out if x <= limit))


@dataclass
class Plan:
    gpus: int
    afd: Deployment | None
    colocated: Deployment | None
    afd_by_ratio: list[Deployment] = field(default_factory=list)
    tp: Deployment | None = None

    @property
    def gain_over_tp(self) -> float | None:
        if self.afd is None or self.tp is None:
            return None
        return self.afd.tok_s_per_gpu / self.tp.tok_s_per_gpu

    @property
    def gain(self) -> float | None:
        if self.afd is None or self.colocated is None:
            return None
        return self.afd.tok_s_per_gpu / self.colocated.tok_s_per_gpu


def _best_batch(make, tpot_s: float, grid: Sequence[int], mem_ok) -> Deployment | None:
    best = None
    for b in grid:
        d = make(b)
        if not mem_ok(d) or d.tpot_s > tpot_s:
            break  # both grow with the batch
        if best is None or d.tok_s_per_gpu > best.tok_s_per_gpu:
            best = d
    return best


def plan(m: Model, cl: Cluster, cal: Calibration, gpus: int, tpot_s: float, context: float,
         routing: str = "uniform", micro_batches: Sequence[int] = (1, 2, 3, 4),
         colocated_micro_batches: Sequence[int] = (1, 2),
         attention_tps: Sequence[int] = (1, 2, 4, 8)) -> Plan:
    """The best AFD deployment (over the attention:FFN split, the attention's tensor
    parallelism, the micro-batches and the batch), the best colocated DP+EP one and the best tensor-parallel one (replicas of TP
    1, 2, 4 or 8) on ``gpus`` GPUs, each under the TPOT target and fitting memory; None
    where nothing fits."""
    usable = cl.usable_bytes()
    grid = batch_grid()
    by_ratio: list[Deployment] = []
    for a in range(1, gpus):
        f = gpus - a
        if m.experts and f > m.experts:
            continue
        if m.ffn_weight_bytes(f) > usable:
            continue
        best_a = None
        for t in attention_tps:
            if a % t or t > cl.gpus_per_host:
                continue
            for mb in micro_batches:
                d = _best_batch(
                    lambda b, a=a, f=f, mb=mb, t=t: afd_deployment(
                        m, cl, cal, a, f, b, mb, context, routing, t),
                    tpot_s, [b for b in grid if b >= mb],
                    lambda d: d.attention_mem_gb * 1e9 <= usable)
                if d and (best_a is None or d.tok_s_per_gpu > best_a.tok_s_per_gpu):
                    best_a = d
        if best_a:
            by_ratio.append(best_a)
    best_afd = max(by_ratio, key=lambda d: d.tok_s_per_gpu, default=None)
    best_col = None
    for mb in colocated_micro_batches:
        d = _best_batch(lambda b, mb=mb: colocated_deployment(m, cl, cal, gpus, b, mb, context,
                                                              routing),
                        tpot_s, [b for b in grid if b >= mb],
                        lambda d: d.attention_mem_gb * 1e9 <= usable)
        if d and (best_col is None or d.tok_s_per_gpu > best_col.tok_s_per_gpu):
            best_col = d
    best_tp = None
    for t in (1, 2, 4, 8):
        if t > cl.gpus_per_host or gpus % t:
            continue
        d = _best_batch(lambda b, t=t: tp_deployment(m, cl, cal, gpus, t, b, context, routing),
                        tpot_s, grid, lambda d: d.attention_mem_gb * 1e9 <= usable)
        if d and (best_tp is None or d.tok_s_per_gpu > best_tp.tok_s_per_gpu):
            best_tp = d
    by_ratio.sort(key=lambda d: -d.tok_s_per_gpu)
    return Plan(gpus, best_afd, best_col, by_ratio, best_tp)


def parse_context(text: str) -> tuple[float, list[tuple[int, float]]]:
    """'4096' or '1024:0.7,8192:0.3' (lengths and shares) -> (mean, the mix). Every cost of
    the model is linear in the context, so the mean stands for the mix."""
    mix = []
    for part in text.split(","):
        length, _, share = part.strip().partition(":")
        try:
            mix.append((int(length), float(share) if share else 1.0))
        except ValueError:
            raise ValueError(f"--context {text!r}: expected LEN or LEN:SHARE,...") from None
    total = sum(w for _, w in mix)
    if total <= 0 or any(n < 0 or w < 0 for n, w in mix):
        raise ValueError(f"--context {text!r}: lengths and shares must be positive")
    return sum(n * w for n, w in mix) / total, mix


# ------------------------------------------------------------------- validation


def check_calibrations(data: dict) -> dict[str, tuple[Card, Calibration]]:
    """Each card's calibration of a validation file (``check_figures``)."""
    cals: dict[str, tuple[Card, Calibration]] = {}
    for key, c in data["calibration"].items():
        card = CARDS[c["card"]]
        if "like" in c:  # another card's fractions of its spec, carried over unchanged
            cals[key] = (card, replace(cals[c["like"]][1], sources=(f"{key} as {c['like']}",)))
            continue
        layer_model = load_model(c["moe_model"])
        mem, flop, p = fit_moe_layer(layer_model, card, c["moe_layer_us"],
                                     c.get("routing", "uniform"))
        cal = replace(ROOFLINE, mem_eff=mem, flop_eff=flop, overlap_p=p,
                      handover_us=c["handover_us"], sources=(key,))
        steps = c["plain_steps"]
        pm = load_model(steps[0]["model"], layers=steps[0].get("layers"))
        fixed, per_token = fit_step_overhead(
            pm, card, cal, [(p["batch"], p["context"], p["tpot_ms"] / 1e3) for p in steps],
            steps[0]["routing"])
        cal = replace(cal, step_overhead_us=fixed, token_overhead_us=per_token)
        if "replicas_step" in c:
            r = c["replicas_step"]
            rm = load_model(r["model"], layers=r.get("layers"))
            cal = replace(cal, shared_mem_eff=fit_shared_mem_eff(
                rm, card, cal, r["engines"], r["batch"], r["context"], r["tpot_ms"] / 1e3,
                r["routing"]))
        cals[key] = (card, cal)
    return cals


def check_figures(data: dict) -> list[dict]:
    """Predict every measured one-GPU figure of a validation file (``benchmarks/
    plan_figures.json``) with its card's calibration, and return the rows with the
    error. The calibration of each card comes from the file's component measurements (MoE
    layer times, hand-over latency) and a few whole steps marked as calibration points
    (one plain engine at two batches: the fixed and per-sequence overhead; replicas at
    once: the shared bandwidth); a card without measurements of its own may take another's
    (``"like": KEY``: the same fractions of its own spec); an AFD figure with several ranks may give its FFN counters
    (``ffn_passes``: passes, joined passes)."""
    cals = check_calibrations(data)
    rows = []
    for f in data["figures"]:
        card, cal = cals[f["calibration"]]
        mm = load_model(f["model"], layers=f.get("layers"))
        passes = 1.0
        if f["mode"] == "afd" and f["engines"] > 1 and "ffn_passes" in f:
            passes = passes_per_round(f["engines"], *f["ffn_passes"])
        pred = predict_one_gpu(mm, card, cal, f["mode"], f["engines"], f["batch"],
                               f["context"], f["routing"], passes)
        meas = f["tpot_ms"] / 1e3
        rows.append({**f, "predicted_tpot_ms": pred * 1e3,
                     "error": (pred - meas) / meas,
                     "calibration_point": f.get("calibration_point", False)})
    return rows


# ------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm.afd.plan",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"preset ({', '.join(sorted(PRESETS))}), config.json or "
                   "its directory")
    p.add_argument("--layers", type=int, help="keep the model's first N layers")
    p.add_argument("--weight-bytes", type=float, help="bytes a weight (default: the "
                   "config's: 1 for fp8 quantization, else its dtype)")
    p.add_argument("--kv-bytes", type=float, help="bytes a KV cache element (default 2)")
    p.add_argument("--dispatch-bytes", type=float, help="bytes an activation element sent "
                   "to the FFN GPUs (1: fp8 dispatch; default: the activations' bytes)")
    p.add_argument("--card", default="h200", help=f"one of {', '.join(sorted(CARDS))}; the "
                   "flags below override its figures")
    p.add_argument("--hbm-tbs", type=float, help="HBM bandwidth, TB/s")
    p.add_argument("--tflops", type=float, help="dense bf16 matrix peak, TFLOP/s (fp8: 2x)")
    p.add_argument("--memory-gb", type=float, help="GPU memory, GB")
    p.add_argument("--link-gbs", type=float, help="NVLink GB/s per GPU and direction")
    p.add_argument("--net-gbs", type=float, help="between hosts: GB/s per GPU and direction")
    p.add_argument("--link-latency-us", type=float, help="inside a host, us")
    p.add_argument("--net-latency-us", type=float, help="between hosts, us")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--memory-util", type=float, default=0.9)
    p.add_argument("--gpus", default="8,16,32", help="GPU counts to plan for")
    p.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT target, ms")
    p.add_argument("--context", default="4096", help="mean context: LEN or LEN:SHARE,...")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform")
    p.add_argument("--micro-batches", default="1,2,3,4", help="AFD micro-batches to try")
    p.add_argument("--calibration", action="append", default=[], metavar="JSON",
                   help="this card's measurements: moe_crossover.py or handover.py JSON, or "
                   "an object of mem_eff, flop_eff, step_overhead_us, layer_overhead_us, "
                   "handover_us (repeatable; later files override)")
    p.add_argument("--uncalibrated", action="store_true", help="the spec sheet alone (the "
                   "roofline), not the H200 measurements the planner starts from")
    for name in ("mem-eff", "flop-eff", "step-overhead-us", "layer-overhead-us",
                 "handover-us"):
        p.add_argument(f"--{name}", type=float, help=f"calibration: {name}")
    p.add_argument("--top", type=int, default=3, help="AFD ratios listed per GPU count")
    p.add_argument("--json", help="write the plan here")
    return p


def card_from_args(a) -> Card:
    if a.card not in CARDS:
        raise ValueError(f"--card {a.card}: one of {', '.join(sorted(CARDS))}")
    c = CARDS[a.card]
    upd = {k: v for k, v in (("hbm_tbs", a.hbm_tbs), ("memory_gb", a.memory_gb),
                             ("nvlink_gbs", a.link_gbs), ("net_gbs", a.net_gbs),
                             ("nvlink_latency_us", a.link_latency_us),
                             ("net_latency_us", a.net_latency_us)) if v is not None}
    if a.tflops is not None:
        upd.update(bf16_tflops=a.tflops, fp8_tflops=2 * a.tflops)
    return replace(c, **upd, gpus_per_host=a.gpus_per_host)


def calibration_from_args(a, card: Card) -> Calibration:
    cal = ROOFLINE if a.uncalibrated else H200_MEASURED
    for path in a.calibration:
        cal = calibration_from_json(json.loads(Path(path).read_text()), card, cal, path)
    for name in ("mem_eff", "flop_eff", "step_overhead_us", "layer_overhead_us",
                 "handover_us"):
        v = getattr(a, name)
        if v is not None:
            cal = replace(cal, **{name: v}, sources=(*cal.sources, f"--{name}"))
    if not 0 < cal.mem_eff <= 1 or not 0 < cal.flop_eff <= 1:
        raise ValueError("mem_eff and flop_eff must lie in (0, 1]")
    return cal


def format_deployment(d: Deployment | None) -> str:
    if d is None:
        return "none fits"
    return (f"{d.ratio:>5s} b={d.batch:<5d} m={d.micro_batches} TPOT {d.tpot_s * 1e3:5.1f} ms "
            f"{d.tok_s_per_gpu:9,.0f} tok/s/GPU ({d.limiter}-bound)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:
        return main_check(argv[1:])
    p = build_parser()
    a = p.parse_args(argv)
    if not a.model:
        p.error("--model is required")
    try:
        m = load_model(a.model, layers=a.layers, weight_bytes=a.weight_bytes,
                       kv_bytes=a.kv_bytes)
        card = card_from_args(a)
        cal = calibration_from_args(a, card)
        ctx, mix = parse_context(a.context)
        gpus = [int(x) for x in a.gpus.split(",") if x.strip()]
        mbs = [int(x) for x in a.micro_batches.split(",") if x.strip()]
    except (ValueError, OSError, json.JSONDecodeError) as e:
        p.error(str(e))
    if any(g < 2 for g in gpus) or any(x < 1 for x in mbs):
        p.error("--gpus must be at least 2 and --micro-batches at least 1")
    cl = Cluster(card, a.gpus_per_host, a.memory_util, dispatch_bytes=a.dispatch_bytes)
    print(f"model {m.name}: {m.layers} layers ({m.moe_layers} MoE, {m.experts} experts top-"
          f"{m.top_k}), {m.total_params() / 1e9:.1f}B params ({m.active_params() / 1e9:.1f}B "
          f"active), {m.weight_bytes:g} B/weight, KV {m.kv_bytes_per_token() / 1e3:.1f} KB/token")
    print(f"card {card.name}: {card.hbm_tbs:g} TB/s, {card.bf16_tflops:g} TFLOP/s bf16, "
          f"{card.memory_gb:g} GB, NVLink {card.nvlink_gbs:g} GB/s, NIC {card.net_gbs:g} GB/s; "
          f"calibration mem_eff {cal.mem_eff:.3f} flop_eff {cal.flop_eff:.3f} step "
          f"{cal.step_overhead_us:g} us hand-over {cal.handover_us:g} us "
          f"({'; '.join(cal.sources)})")
    print(f"TPOT <= {a.tpot_ms:g} ms, mean context {ctx:,.0f} tokens, routing {a.routing}")
    plans = []
    print(f"\n{'GPUs':>4}  {'deployment':10s} {'A:F, batch b, micro-batches m, TPOT, throughput':64s}"
          f"  AFD against it")
    for n in gpus:
        pl = plan(m, cl, cal, n, a.tpot_ms / 1e3, ctx, a.routing, mbs)
        plans.append(pl)
        gain = f"{pl.gain:.2f}x" if pl.gain else "-"
        tp_gain = f"{pl.gain_over_tp:.2f}x" if pl.gain_over_tp else "-"
        print(f"{n:>4}  AFD        {format_deployment(pl.afd):64s}")
        for d in pl.afd_by_ratio[1:a.top]:
            print(f"{'':>4}             {format_deployment(d)}")
        print(f"{'':>4}  DP+EP      {format_deployment(pl.colocated):64s}  AFD {gain}")
        print(f"{'':>4}  TP         {format_deployment(pl.tp):64s}  AFD {tp_gain}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "model": asdict(m), "card": asdict(card), "calibration": asdict(cal),
            "tpot_ms": a.tpot_ms, "context_mean": ctx, "context_mix": mix,
            "plans": [{"gpus": pl.gpus, "gain": pl.gain, "gain_over_tp": pl.gain_over_tp,
                       "afd": _dep_json(pl.afd), "colocated": _dep_json(pl.colocated),
                       "tp": _dep_json(pl.tp),
                       "afd_by_ratio": [_dep_json(d) for d in pl.afd_by_ratio]}
                      for pl in plans]}, indent=1))
    return 0


def _dep_json(d: Deployment | None) -> dict | None:
    if d is None:
        return None
    return {**asdict(d), "tok_s_per_gpu": d.tok_s_per_gpu, "ratio": d.ratio,
            "limiter": d.limiter}


def main_check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm.afd.plan check",
                                description="predicted against measured one-GPU figures")
    p.add_argument("figures", help="validation file (benchmarks/plan_figures.json)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    data = json.loads(Path(a.figures).read_text())
    for key, (card, cal) in check_calibrations(data).items():
        print(f"{key}: {card.name}, mem_eff {cal.mem_eff:.3f}, flop_eff {cal.flop_eff:.3f}, "
              f"overlap p {cal.overlap_p:g}, "
              f"shared_mem_eff {cal.concurrent_mem_eff:.3f}, step {cal.step_overhead_us:.0f} "
              f"us + {cal.token_overhead_us:.2f} us a sequence, hand-over "
              f"{cal.handover_us:g} us")
    rows = check_figures(data)
    print(f"{'calibration':15s} {'figure':46s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for r in rows:
        mark = "  (calibration point)" if r["calibration_point"] else ""
        print(f"{r['calibration']:15s} {r['what'][:46]:46s} {r['tpot_ms']:8.2f}  "
              f"{r['predicted_tpot_ms']:8.2f}  {r['error']:+6.1%}{mark}")
    checked = [abs(r["error"]) for r in rows if not r["calibration_point"]]
    if checked:
        print(f"\n{len(checked)} figures (calibration points left out): |error| median "
              f"{statistics.median(checked):.1%}, max {max(checked):.1%}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
