"""The balanced routing strategy for benchmarks (vllm.afd.routing, `afd_balanced`)."""

from __future__ import annotations

import pytest
import torch

from vllm.afd import routing


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (37, 8, 2), (64, 64, 6),
                                                    (5, 160, 8), (300, 16, 4)])
@pytest.mark.parametrize("seed", [0, 3])
def test_balanced_counts_differ_by_at_most_one(tokens, experts, top_k, seed):
    weights, ids = routing.balanced_topk(tokens, experts, top_k, seed, "cpu")
    assert ids.shape == weights.shape == (tokens, top_k)
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    assert counts.sum() == tokens * top_k
    assert counts.max() - counts.min() <= 1
    # every token's experts are distinct, weights sum to one
    assert all(len(set(row.tolist())) == top_k for row in ids)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))


def test_deterministic_from_seed():
    a = routing.balanced_topk(50, 8, 2, 7, "cpu")[1]
    b = routing.balanced_topk(50, 8, 2, 7, "cpu")[1]
    c = routing.balanced_topk(50, 8, 2, 8, "cpu")[1]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_registered_with_vllms_routing_simulator(monkeypatch):
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulator,
    )

    routing.register()
    assert routing.STRATEGY_NAME in RoutingSimulator.get_available_strategies()
    monkeypatch.setenv("VLLM_AFD_ROUTING_SEED", "1")
    logits = torch.randn(33, 8)
    weights, ids = RoutingSimulator.simulate_routing(
        torch.randn(33, 16), logits, routing.STRATEGY_NAME, 2, torch.int32
    )
    assert ids.dtype == torch.int32
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    assert counts.max() - counts.min() <= 1
    assert ids[0].tolist() == [1, 2]  # seed 1


def test_too_many_choices_is_an_error():
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        routing.balanced_topk(4, 2, 3, 0, "cpu")
