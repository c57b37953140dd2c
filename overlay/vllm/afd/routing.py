# SPDX-License-Identifier: Apache-2.0
"""Balanced expert routing for benchmarks (``afd_balanced``).

Dummy or random weights route tokens unevenly, so the expert load of a
benchmark is not what a trained model gives. With
``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=afd_balanced`` vLLM's MoE routing
simulator ignores the router logits and sends the k choices of token t to
experts ``(seed + t*k + j) % num_experts`` for j in 0..k-1: within one call
every expert gets the same number of assignments give or take one, each
token's experts are distinct (k <= num_experts); an expert-parallel rank's
load (a contiguous block of experts) is off the mean by less than one
assignment per expert. The weights are 1/k. Deterministic from ``VLLM_AFD_ROUTING_SEED`` (default 0).

For benchmarks only: it changes the model's outputs.
"""

from __future__ import annotations

import os

import torch

STRATEGY_NAME = "afd_balanced"


def balanced_topk(
    num_tokens: int, num_experts: int, top_k: int, seed: int, device, indices_type=None
) -> tuple[torch.Tensor, torch.Tensor]:
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds the number of experts {num_experts}")
    slots = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
    ids = (slots + seed) % num_experts
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
    return weights, ids.to(indices_type or torch.int32)


_registered = False


def register() -> None:
    """Register the strategy with vLLM's routing simulator (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulator,
        RoutingStrategy,
    )

    class BalancedRouting(RoutingStrategy):
        def route_tokens(self, hidden_states, router_logits, top_k, indices_type=None):
            seed = int(os.environ.get("VLLM_AFD_ROUTING_SEED", "0"))
            return balanced_topk(
                router_logits.shape[0], router_logits.shape[-1], top_k, seed,
                router_logits.device, indices_type,
            )

    RoutingSimulator.register_strategy(STRATEGY_NAME, BalancedRouting())
    _registered = True
