"""The registry of supported model families (vllm.afd.architectures): the
config-time refusal of other architectures and of a router placement a family cannot
take; that the registry, the patches of every line, the oracle cases and the docs table
(docs/models.md) agree; and the model-split pieces the new families need (the weight
filter by module path and layer names, the router named ``router``, the router that
returns a plain tensor or casts its input)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import make_models
import models_table
import pytest
import test_afd_oracle
import torch
from torch import nn

from vllm.afd import architectures as arch
from vllm.afd import model_split
from vllm.afd.ffn_runner import _GivenRouterLogits
from vllm.config.afd import AFDConfig, AFDConfigError

ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------- config-time refusal


def registry(**archs: str) -> SimpleNamespace:
    """A stand-in for vLLM's ModelRegistry: architecture -> "module.Class"."""
    models = {}
    for name, target in archs.items():
        module, cls = target.split(".")
        models[name] = SimpleNamespace(
            module_name=f"vllm.model_executor.models.{module}", class_name=cls
        )
    return SimpleNamespace(models=models)


def vllm_config(architecture: str, target: str | None) -> SimpleNamespace:
    reg = registry(**({architecture: target} if target else {}))
    model_config = SimpleNamespace(architecture=architecture, registry=reg, enforce_eager=True)
    return SimpleNamespace(model_config=model_config)


def afd(role: str = "attention", **extra) -> AFDConfig:
    return AFDConfig.from_dict({"role": role, **extra})


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_unmarked_architecture_refused_at_config_time(role):
    with pytest.raises(AFDConfigError) as e:
        afd(role).verify_with_vllm_config(vllm_config("FalconForCausalLM", "falcon.FalconForCausalLM"))
    msg = str(e.value)
    assert "architecture 'FalconForCausalLM' is not AFD-enabled" in msg
    assert "docs/adding-a-model.md" in msg
    for family in arch.FAMILIES:  # names every supported family and its classes
        assert family.name in msg
        for cls in family.model_classes:
            assert cls.split(".", 1)[1] in msg


def test_architecture_vllm_does_not_know_refused():
    with pytest.raises(AFDConfigError, match="'MyPluginForCausalLM' is not AFD-enabled"):
        afd().verify_with_vllm_config(vllm_config("MyPluginForCausalLM", None))


def test_alias_of_a_marked_class_accepted():
    # vLLM serves MistralModel with llama.LlamaForCausalLM: the marked Llama layers.
    afd().verify_with_vllm_config(vllm_config("MistralModel", "llama.LlamaForCausalLM"))


@pytest.mark.parametrize("family", arch.FAMILIES, ids=lambda f: f.name)
def test_router_placement_per_family(family):
    target, line = family.model_classes[0], family.lines[0]
    name = target.split(".", 1)[1]
    assert arch.check(name, target, False, line) is None
    problem = arch.check(name, target, True, line)
    if family.gate_on_attention:
        assert problem is None
    else:
        assert f"compute_gate_on_attention is not supported for {family.name}" in problem
        assert family.gate_refused in problem


def test_refused_on_a_line_that_does_not_mark_the_family(monkeypatch):
    newer = arch.Family("Newer", "newer.py", ("newer.NewerForCausalLM",), ("NewerMoE",),
                        cpu_oracle=("test_oracle_family[newer]",), lines=("0.32.0",))  # fmt: skip
    monkeypatch.setattr(arch, "FAMILIES", (*arch.FAMILIES, newer))
    problem = arch.check("NewerForCausalLM", "newer.NewerForCausalLM", False, "0.26.0")
    assert "'NewerForCausalLM' is not AFD-enabled on vLLM 0.26.0 (marked on 0.32.0)" in problem
    assert arch.check("NewerForCausalLM", "newer.NewerForCausalLM", False, "0.32.0") is None


def test_gate_refused_through_the_config():
    config = vllm_config("LlamaForCausalLM", "llama.LlamaForCausalLM")
    afd("ffn").verify_with_vllm_config(config)
    with pytest.raises(AFDConfigError, match="not supported for Llama .* no router"):
        afd("ffn", compute_gate_on_attention=True).verify_with_vllm_config(config)


def test_engine_config_refuses_an_unmarked_checkpoint(tmp_path):
    """A real vLLM engine configuration: the refusal comes from create_engine_config,
    before any process starts or anything is loaded."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
           "n_head": 2, "n_layer": 1, "n_positions": 128, "vocab_size": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=128,
                      afd_config={"role": "ffn"})  # fmt: skip
    # pydantic wraps the AFDConfigError of VllmConfig's validation (a ValueError)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not AFD-enabled"):
        args.create_engine_config()


@pytest.mark.parametrize("family", [
    pytest.param(f, id=f.name, marks=test_afd_oracle.unless_marked_here(f)) for f in arch.FAMILIES
])
def test_families_resolve_in_vllm(family):
    """The installed vLLM knows every model class of a family marked on its line."""
    from vllm.model_executor.models import ModelRegistry

    known = {arch.resolve_model_class(ModelRegistry, a) for a in ModelRegistry.models}
    assert set(family.model_classes) <= known


# ------------------------------------------------------------------ registry vs tree

# What a patch passes to afd_ffn_module where it is not a class name.
MARK_ALIASES = {"self.mlp_cls": "MLPBlock"}  # gpt_oss.TransformerBlock.mlp_cls = MLPBlock


def series_dir(line: str) -> Path:
    pin = (ROOT / "VLLM_VERSION").read_text()
    return ROOT / "patches" if f"VERSION={line}\n" in pin else ROOT / "targets" / line / "patches"


def marked_blocks(line: str) -> set[tuple[str, str]]:
    """(model file, block class) for every afd_ffn_module(...) a patch of ``line`` adds."""
    folder = series_dir(line)
    names = [n for n in (folder / "series").read_text().split() if n.endswith(".patch")]
    marked = set()
    for name in names:
        current = None
        for row in (folder / name).read_text().splitlines():
            if row.startswith("diff --git a/"):
                current = row.split()[2][2:]
            elif row.startswith("+") and not row.startswith("+++") and current:
                for token in re.findall(r"afd_ffn_module\(([\w.]+)\)", row):
                    marked.add((Path(current).name, MARK_ALIASES.get(token, token)))
    return marked


@pytest.mark.parametrize("line", arch.LINES)
def test_patches_mark_exactly_the_registry(line):
    """A block a patch marks without a family (no oracle, no docs) fails, and so does a
    family whose blocks are not marked on a line it lists."""
    want = {(f.model_file, b) for f in arch.FAMILIES if line in f.lines for b in f.ffn_blocks}
    got = marked_blocks(line)
    assert got - want == set(), f"{line}: marked, but no family lists them"
    assert want - got == set(), f"{line}: listed, but no patch marks them"


def parametrized_ids(func) -> set[str]:
    ids = set()
    for mark in getattr(func, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == "name":
            values = [v.values[0] if hasattr(v, "values") else v for v in mark.args[1]]
            ids |= {f"{func.__name__}[{v}]" for v in values}
    return ids


def gpu_oracle_ids() -> set[str]:
    """``function[name]`` for every name a tests/gpu/test_gpu_oracle.py function is
    parametrized over (its other parameters aside)."""
    tree = ast.parse((ROOT / "tests" / "gpu" / "test_gpu_oracle.py").read_text())
    ids = set()
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("parametrize"):
                if ast.literal_eval(dec.args[0]) == "name":
                    ids |= {f"{fn.name}[{v}]" for v in ast.literal_eval(dec.args[1])}
    return ids


def test_every_family_has_oracle_cases_that_exist():
    cpu = set()
    for func in vars(test_afd_oracle).values():
        if callable(func) and getattr(func, "__name__", "").startswith("test_"):
            cpu |= parametrized_ids(func)
    gpu = gpu_oracle_ids()
    for family in arch.FAMILIES:
        assert family.cpu_oracle or family.gpu_oracle, f"{family.name}: no oracle case"
        assert set(family.cpu_oracle) <= cpu, family.name
        assert set(family.gpu_oracle) <= gpu, family.name
        assert set(family.gpu_lines) <= set(family.lines), family.name


def test_family_cases_have_checkpoints_and_families():
    """Each family case runs a checkpoint of make_models whose architecture is one of the
    family's classes, and the family lists the case."""
    families = {f.name: f for f in arch.FAMILIES}
    for name, (family_name, _, _) in test_afd_oracle.FAMILY_CASES.items():
        assert name in make_models.MODELS, f"{name}: no checkpoint in scripts/make_models.py"
        family = families[family_name]
        assert f"test_oracle_family[{name}]" in family.cpu_oracle, (name, family.name)
        architecture = make_models.MODELS[name][0]["architectures"][0]
        assert architecture in {c.split(".", 1)[1] for c in family.model_classes}, name


def test_docs_table_is_current():
    doc = models_table.DOC.read_text()
    assert doc == models_table.render(doc, models_table.load_registry()), (
        "docs/models.md is stale: run `make models-table`"
    )


def test_docs_table_names_every_family():
    table = models_table.table(arch)
    for family in arch.FAMILIES:
        assert f"| {family.name} |" in table


# ------------------------------------------------------------------ model-split pieces


class Block(nn.Module):
    def __init__(self, router: str = "gate"):
        super().__init__()
        setattr(self, router, nn.Linear(4, 3, bias=False))
        self.experts = nn.Linear(4, 4, bias=False)


def remote(block: nn.Module, prefix: str, router: str = "gate", gated: bool = False,
           layer_names: tuple[str, ...] = ()) -> nn.Module:  # fmt: skip
    block.__class__ = model_split._remote_class(type(block))
    block.afd_prefix = prefix
    block.afd_router = router
    block.afd_gate_on_attention = gated
    block.afd_layer_names = layer_names
    return block


class Layer(nn.Module):
    def __init__(self, **blocks: nn.Module):
        super().__init__()
        for name, block in blocks.items():
            setattr(self, name, block)


def model_of(*layers: nn.Module) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(layers)
    return model


def kept(model: nn.Module, names: list[str]) -> list[str]:
    return [n for n, _ in model_split.filter_weights(model, [(n, None) for n in names])]


def test_filter_weights_uses_the_module_path_too():
    """MiniMax-M2 builds block_sparse_moe with the prefix ``mlp``: its checkpoint tensors
    are under the module path, which the prefix alone missed."""
    block = remote(Block(), "model.layers.0.mlp")
    model = model_of(Layer(block_sparse_moe=block))
    names = ["model.layers.0.block_sparse_moe.gate.weight",
             "model.layers.0.block_sparse_moe.experts.0.w1.weight",
             "model.layers.0.block_sparse_moe.e_score_correction_bias",
             "model.layers.0.self_attn.qkv_proj.weight"]  # fmt: skip
    assert kept(model, names) == ["model.layers.0.self_attn.qkv_proj.weight"]


def test_filter_weights_keeps_the_router_under_either_name():
    gate = remote(Block(), "model.layers.0.mlp", gated=True)
    router = remote(Block("router"), "model.layers.1.mlp", router="router", gated=True)
    model = model_of(Layer(mlp=gate), Layer(mlp=router))
    names = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.w",
             "model.layers.1.mlp.router.weight", "model.layers.1.mlp.router.bias",
             "model.layers.1.mlp.experts.w"]  # fmt: skip
    assert kept(model, names) == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.router.weight",
        "model.layers.1.mlp.router.bias",
    ]


def test_filter_weights_drops_the_layer_names_a_family_loads_into_the_block():
    """Step-3: prefixes ``.layers.1`` (no ``model``), and the checkpoint's
    ``model.layers.1.share_expert.*`` load into the block at ``model.layers.1.moe``."""
    block = remote(Block(), ".layers.1.moe", layer_names=("share_expert",))
    model = model_of(Layer(), Layer(moe=block))
    names = ["model.layers.1.moe.gate_proj.weight", "model.layers.1.share_expert.up_proj.weight",
             "model.layers.0.share_expert.up_proj.weight", "model.layers.1.self_attn.wq.weight"]
    assert kept(model, names) == [
        "model.layers.0.share_expert.up_proj.weight",
        "model.layers.1.self_attn.wq.weight",
    ]


class ReplicatedLike(nn.Module):
    """vLLM's ReplicatedLinear contract: output_size, params_dtype, (out, bias) unless
    return_bias=False."""

    def __init__(self, return_bias: bool = True):
        super().__init__()
        self.output_size, self.params_dtype, self.return_bias = 3, torch.float32, return_bias
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        out = x @ self.weight.t()
        return (out, None) if self.return_bias else out


class MoE(nn.Module):
    """A block as the families write it: the router's output handed to the experts."""

    def __init__(self, router: str, module: nn.Module, cast: bool = False):
        super().__init__()
        self.router_name, self.cast = router, cast
        setattr(self, router, module)
        self.experts = nn.Identity()
        self.seen = None

    def forward(self, x):
        out = getattr(self, self.router_name)(x.float() if self.cast else x)
        self.seen = out
        logits = out[0] if isinstance(out, tuple) else out
        return x[:, :3] * 0 + logits


@pytest.mark.parametrize(
    "router, module, as_tuple",
    [
        ("gate", ReplicatedLike(), True),  # Mixtral, Qwen2-MoE, ...: (logits, bias)
        ("gate", nn.Linear(4, 3, bias=False), False),  # GLM-4.5: a plain nn.Linear
        ("router", ReplicatedLike(return_bias=False), False),  # GPT-OSS: return_bias=False
        ("router", ReplicatedLike(), True),  # Llama 4
    ],
)
def test_ffn_role_runs_the_block_on_the_given_logits(router, module, as_tuple):
    block = MoE(router, module)
    given = torch.full((2, 3), 7.0)
    out = _GivenRouterLogits(block)(block, torch.zeros(2, 4), given)
    assert torch.equal(out, given)
    assert isinstance(block.seen, tuple) == as_tuple  # the form the block unpacks
    assert getattr(block, router) is module  # swapped back


@pytest.mark.parametrize(
    "router, module, dtype",
    [("gate", ReplicatedLike(), None), ("gate", nn.Linear(4, 3).float(), torch.float32),
     ("router", ReplicatedLike(return_bias=False), None)],  # fmt: skip
)
def test_attention_role_router_logits_as_the_block_computes_them(router, module, dtype):
    block = MoE(router, module, cast=dtype is not None)
    x = torch.randn(2, 4, dtype=torch.bfloat16 if dtype else torch.float32)
    want = block(x)
    stand_in = remote(block, "model.layers.0.mlp", router=router, gated=True)
    stand_in.afd_router_dtype = dtype
    assert torch.equal(stand_in.afd_router_logits(x), want)


def test_router_name():
    assert model_split.router_name(Block()) == "gate"
    assert model_split.router_name(Block("router")) == "router"
    dense = nn.Module()
    dense.gate_up_proj = nn.Linear(4, 8)
    assert model_split.router_name(dense) is None
