# SPDX-License-Identifier: Apache-2.0
"""Split a model between the AFD attention and FFN roles.

Models mark their FFN block with one call at construction time::

    self.mlp = afd_ffn_module(LlamaMLP)(hidden_size=..., prefix=f"{prefix}.mlp")

Without AFD ``afd_ffn_module(cls)`` is ``cls``. With AFD:

* attention role: the block becomes a weightless :class:`RemoteFFN` whose
  forward is the opaque op ``torch.ops.vllm.afd_remote_ffn`` (safe under
  torch.compile); checkpoint weights of the block are filtered out at load.
* FFN role: the whole model is constructed on the ``meta`` device except the
  FFN blocks, so memory holds only MLP/MoE weights; weight loading into the
  meta parts is a no-op and post-load processing runs on the FFN blocks only.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllm.afd import architectures, attention, routing
from vllm.afd.architectures import routed_experts
from vllm.afd.checkpoint import checkpoint_identity
from vllm.afd.protocol import PROTOCOL_VERSION
from vllm.afd.roles import afd_config, current_vllm_config
from vllm.logger import init_logger

logger = init_logger(__name__)

META = torch.device("meta")


# Process-wide AFD state of the model being built / served.
class AFDModelState:
    def __init__(self) -> None:
        self.real_device: torch.device | None = None
        self.ffn_modules: dict[int, nn.Module] = {}
        # Class name of each layer's FFN block (both roles): the dense/MoE layer map.
        self.block_classes: dict[int, str] = {}


STATE = AFDModelState()


def _layer_index(prefix: str) -> int:
    for part in reversed(prefix.split(".")):
        if part.isdigit():
            return int(part)
    raise ValueError(f"AFD: cannot find a layer index in module prefix {prefix!r}")


class RemoteFFN:
    """Mixin of the attention role's stand-in for an FFN block.

    The stand-in is an instance of a subclass of the model's own FFN class
    (``isinstance`` checks and attributes such as ``n_routed_experts`` that
    model code reads keep working), constructed on the meta device and then
    stripped of every parameter and buffer: it holds no weights, and its
    forward sends the hidden states to the FFN rank.
    """

    afd_layer_idx: int
    afd_prefix: str
    afd_gate_on_attention: bool
    afd_router: str | None  # the block's router submodule ("gate", "router")
    afd_router_dtype: torch.dtype | None  # what the block casts the router's input to
    afd_layer_names: tuple[str, ...]  # checkpoint names of the layer that load into it

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.afd_gate_on_attention:
            router_logits = self.afd_router_logits(hidden_states)
            return torch.ops.vllm.afd_remote_ffn_gated(
                hidden_states, router_logits, self.afd_layer_idx
            )
        return torch.ops.vllm.afd_remote_ffn(hidden_states, self.afd_layer_idx)

    def afd_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router logits, computed as the block's own forward computes them."""
        x = hidden_states
        if self.afd_router_dtype is not None:
            x = x.to(dtype=self.afd_router_dtype)
        out = getattr(self, self.afd_router)(x)
        # vLLM linear layers return (output, bias) unless built with return_bias=False
        return out[0] if isinstance(out, tuple) else out

    def extra_repr(self) -> str:
        return f"AFD remote FFN, layer={self.afd_layer_idx}"


_REMOTE_CLASSES: dict[type, type] = {}


def _remote_class(cls: type) -> type:
    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = type(f"RemoteFFN_{cls.__name__}", (RemoteFFN, cls), {})
    return _REMOTE_CLASSES[cls]


# Names of an MoE block's router submodule ("router": GPT-OSS, Llama 4).
ROUTER_NAMES = ("gate", "router")


def router_name(module: nn.Module) -> str | None:
    """The submodule of an MoE block (one with an ``experts`` runner) that computes the
    router logits, which may run on the attention role; None for a dense block."""
    if not hasattr(module, "experts"):
        return None
    for name in ROUTER_NAMES:
        if isinstance(getattr(module, name, None), nn.Module):
            return name
    return None


def is_routed_moe(module: nn.Module) -> bool:
    """An MoE block whose router can run on the attention role."""
    return router_name(module) is not None


def router_input_dtype(family) -> torch.dtype | None:
    """The dtype the family's MoE blocks cast the router's input to on this vLLM line,
    None when they pass the hidden states as they are."""
    line = architectures.running_line()
    return torch.float32 if family is not None and line in family.router_input_float32 else None


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Give a meta-built module real (uninitialized) storage, keeping each
    parameter's class and attributes (weight loaders, shard dims)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            data = torch.empty(p.shape, dtype=p.dtype, device=device)
            new = torch.Tensor._make_subclass(type(p), data, p.requires_grad)
            new.__dict__.update(p.__dict__)
            sub._parameters[name] = new


def _strip_tensors(module: nn.Module, keep: nn.Module | None = None) -> None:
    """No weights: drop every parameter and buffer (except under ``keep``)."""
    kept = set(keep.modules()) if keep is not None else set()
    for sub in module.modules():
        if sub in kept:
            continue
        sub._parameters.clear()
        sub._buffers.clear()


def _detach_remote_children(vllm_config, model: nn.Module) -> None:
    """After the model is built, unhook the stand-ins' submodules (experts,
    shared experts, projections) so that nothing that walks the model or the
    static forward context (post-load processing, kernel warm-up, MoE layer
    scans) finds weightless layers; the router stays when it runs here."""
    compilation = vllm_config.compilation_config
    ctx = compilation.static_forward_context
    for m in model.modules():
        if not isinstance(m, RemoteFFN):
            continue
        for name in list(m._modules):
            if not (m.afd_gate_on_attention and name == m.afd_router):
                del m._modules[name]
        prefix = m.afd_prefix + "."
        for key in [k for k in ctx if k.startswith(prefix)]:
            del ctx[key]
        moe_layers = getattr(compilation, "static_all_moe_layers", None)
        if moe_layers:
            moe_layers[:] = [n for n in moe_layers if not n.startswith(prefix)]


def _build_remote(cls, args, kwargs, prefix: str, layer_idx: int, cfg) -> nn.Module:
    with META:
        module = cls(*args, **kwargs)
    router = router_name(module)
    gated = cfg.compute_gate_on_attention and router is not None
    if gated:
        _materialize(getattr(module, router), STATE.real_device)
    _strip_tensors(module, keep=getattr(module, router) if gated else None)
    module.__class__ = _remote_class(cls)
    module.afd_layer_idx = layer_idx
    module.afd_prefix = prefix
    module.afd_gate_on_attention = gated
    family = architectures.model_family(current_vllm_config().model_config)
    module.afd_router = router
    module.afd_router_dtype = router_input_dtype(family) if gated else None
    module.afd_layer_names = family.layer_checkpoint_names if family is not None else ()
    attention.register_remote_layer(layer_idx, gated)
    return module


def afd_ffn_module(cls):
    """Return a constructor for the FFN block ``cls`` that honours the AFD role."""
    cfg = afd_config()
    if cfg is None:
        return cls

    def build(*args, **kwargs):
        prefix = kwargs.get("prefix", "")
        layer_idx = _layer_index(prefix)
        STATE.block_classes[layer_idx] = cls.__name__
        if cfg.is_attention:
            return _build_remote(cls, args, kwargs, prefix, layer_idx, cfg)
        device = STATE.real_device
        ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with ctx:
            module = cls(*args, **kwargs)
        STATE.ffn_modules[layer_idx] = module
        return module

    return build


@contextlib.contextmanager
def construction_device(vllm_config, target_device: torch.device):
    """Device to construct the model on: ``meta`` for the FFN role (whose FFN
    blocks are then built on ``target_device`` by :func:`afd_ffn_module`)."""
    routing.register()  # benchmark routing strategy, available to both roles and plain vLLM
    cfg = afd_config(vllm_config)
    STATE.real_device = target_device
    STATE.block_classes.clear()
    if cfg is None or not cfg.is_ffn:
        with target_device:
            yield
        return
    STATE.ffn_modules.clear()
    with META:
        yield


def filter_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """Attention role: drop checkpoint tensors of the remote FFN blocks (a
    model without :class:`RemoteFFN` modules is passed through).

    A block's tensors are those under its module prefix (``model.layers.7.mlp``) or
    under its path in the model, where a model names the two differently (MiniMax-M2
    builds ``block_sparse_moe`` with the prefix ``mlp``; Step-3 prefixes its layers
    ``.layers.7``), and the layer's tensors its family loads into it from outside its
    path (Family.layer_checkpoint_names: Step-3's ``share_expert``)."""
    remote = [(path, m) for path, m in model.named_modules() if isinstance(m, RemoteFFN)]
    prefixes = tuple(
        {p + "." for path, m in remote for p in (m.afd_prefix, path)}
        | {f"{path.rpartition('.')[0]}.{name}." for path, m in remote for name in m.afd_layer_names}
    )
    if not prefixes:
        return weights
    # Router weights stay on the attention role with compute_gate_on_attention.
    kept = tuple(
        {
            f"{p}.{m.afd_router}."
            for path, m in remote
            if m.afd_gate_on_attention
            for p in (m.afd_prefix, path)
        }
    )

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        dropped = 0
        for name, tensor in weights:
            if name.startswith(prefixes) and not (kept and name.startswith(kept)):
                dropped += 1
                continue
            yield name, tensor
        logger.info("AFD attention role: skipped %d FFN checkpoint tensors", dropped)

    return gen()


def post_load(vllm_config, model: nn.Module, model_config, target_device) -> bool:
    """Run post-load processing for the role. Returns False when AFD does not
    apply (the caller then runs vLLM's normal processing)."""
    cfg = afd_config(vllm_config)
    if cfg is None:
        return False
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    remote = [m for m in model.modules() if isinstance(m, RemoteFFN)]
    if not (remote if cfg.is_attention else STATE.ffn_modules):
        raise RuntimeError(
            f"AFD {cfg.role} role: {type(model).__name__} has no AFD FFN block; the "
            "architecture is not AFD-enabled (see docs/adding-a-model.md)"
        )
    if cfg.is_ffn:
        for module in STATE.ffn_modules.values():
            process_weights_after_loading(module, model_config, target_device)
        return True
    _detach_remote_children(vllm_config, model)
    process_weights_after_loading(model, model_config, target_device)
    gated = sum(m.afd_gate_on_attention for m in remote)
    if gated:
        logger.info("AFD: router of %d MoE layer(s) runs on the attention role", gated)
    layers = [m.afd_layer_idx for m in remote]
    attention.connect(vllm_config, ffn_fingerprint(vllm_config, layers),
                      router_logits_width(vllm_config))  # fmt: skip
    attention.open_steps_at_forward(model)
    return True


def router_logits_width(vllm_config) -> int | None:
    """Number of routed experts (the width of the router logits), if any."""
    return routed_experts(vllm_config.model_config.hf_text_config)


# Config keys of the FFN blocks' shape and routing (those a model has are compared).
MLP_CONFIG_KEYS = (
    "hidden_act",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "moe_layer_freq",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    # the keys of the other families' layer mix, routing and shared experts
    "moe_k",
    "moe_top_k",
    "moe_num_shared_experts",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "moe_layer_interval",
    "moe_layers_enum",
    "share_expert_dim",
    "interleave_moe_layer_step",
    "intermediate_size_mlp",
    "use_routing_bias",
    "norm_expert_weight",
    "swiglu_limit",
)


def mlp_config(hf_config) -> str:
    """``key=value`` pairs of the MLP_CONFIG_KEYS the model config has."""
    parts = []
    for key in MLP_CONFIG_KEYS:
        value = getattr(hf_config, key, None)
        if value is not None:
            parts.append(f"{key}={json.dumps(value, sort_keys=True, default=str)}")
    return ",".join(parts)


def ffn_block_map(layers: list[int], classes: dict[int, str]) -> str:
    """The FFN block class of each layer, runs collapsed (``"0:A 1-2:B"``)."""
    runs: list[list] = []
    for i in sorted(layers):
        name = classes.get(i, "?")
        if runs and runs[-1][2] == name and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, name])
    return " ".join(f"{a}:{n}" if a == b else f"{a}-{b}:{n}" for a, b, n in runs)


def ffn_fingerprint(vllm_config, ffn_layers: list[int]) -> dict:
    """What both roles must agree on (see vllm.afd.protocol.FINGERPRINT_KEYS)."""
    cfg = afd_config(vllm_config)
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    try:
        from vllm._afd_revision import AFD_REVISION  # written into the custom wheel
    except ImportError:
        AFD_REVISION = "dev"
    archs = getattr(model_config.hf_config, "architectures", None) or ["?"]
    t0 = time.perf_counter()
    checkpoint = checkpoint_identity(model_config, vllm_config.load_config)
    logger.info("AFD: checkpoint identity %s (%.2f s)", checkpoint, time.perf_counter() - t0)
    return {
        "protocol": PROTOCOL_VERSION,
        "architecture": archs[0],
        "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
        "hidden_size": model_config.get_hidden_size(),
        "ffn_layers": sorted(ffn_layers),
        "ffn_blocks": ffn_block_map(ffn_layers, STATE.block_classes),
        "num_experts": router_logits_width(vllm_config),
        "mlp_config": mlp_config(hf),
        "dtype": str(model_config.dtype).replace("torch.", ""),
        "num_attention_ranks": cfg.num_attention_ranks,
        "num_ffn_ranks": cfg.num_ffn_ranks,
        "connector": cfg.connector,
        "compute_gate_on_attention": cfg.compute_gate_on_attention,
        "max_num_tokens": int(vllm_config.scheduler_config.max_num_batched_tokens),
        "afd_revision": AFD_REVISION,
        "checkpoint": checkpoint,
    }
