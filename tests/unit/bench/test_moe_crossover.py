"""benchmarks/moe_crossover.py: the roofline model and the torch reference of one MoE layer."""

from __future__ import annotations

import json

import moe_crossover as mc  # benchmarks/moe_crossover.py
import pytest
import torch

DSV2 = mc.SHAPES["deepseek-v2-lite"]


def test_expected_active_experts_limits():
    assert mc.expected_active_experts(1, 64, 6) == pytest.approx(6)
    assert mc.expected_active_experts(10_000, 64, 6) == pytest.approx(64)
    seq = [mc.expected_active_experts(t, 64, 6) for t in (1, 2, 8, 32, 128)]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)


def test_roofline_bytes_and_flops_of_deepseek_v2_lite():
    r = mc.roofline(DSV2, 4096)
    expert = 3 * 2048 * 1408 * 2  # gate, up, down in bf16
    shared = 2 * expert
    gate = 2048 * 64 * 2
    assert r.active_experts == pytest.approx(64)
    assert r.weight_bytes == pytest.approx(64 * expert + shared + gate)
    flops = 2 * 3 * 2048 * 1408 * (4096 * 6 + 4096 * 2) + 2 * 2048 * 64 * 4096
    assert r.flops == pytest.approx(flops)
    # one rank of an expert-parallel group of 2: half the experts and half the shared MLP
    r2 = mc.roofline(DSV2, 4096, ep=2)
    assert r2.weight_bytes == pytest.approx(32 * expert + shared / 2 + gate)


def test_decode_batch_is_memory_bound_and_crossover_is_consistent():
    assert mc.roofline(DSV2, 64).memory_s > 10 * mc.roofline(DSV2, 64).compute_s
    t = mc.crossover_tokens(DSV2)
    assert t is not None
    before, at = mc.roofline(DSV2, t - 1), mc.roofline(DSV2, t)
    assert before.compute_s < before.memory_s and at.compute_s >= at.memory_s
    # twice the bandwidth: the weight reads take half the time, so the crossover comes at
    # half the tokens, a little less since the activations' bytes grow with the tokens
    t2 = mc.crossover_tokens(DSV2, peak_tbs=9.6)
    assert 0.4 * t < t2 < 0.5 * t
    # a machine that never gets there within the limit
    assert mc.crossover_tokens(DSV2, peak_tflops=1e9, limit=4096) is None


def test_knee_tokens():
    pts = [(16, 100.0), (64, 110.0), (256, 140.0), (1024, 160.0), (2048, 300.0)]
    assert mc.knee_tokens(pts) == 1024
    assert mc.knee_tokens(pts, factor=3.0) == 2048
    assert mc.knee_tokens(pts, factor=4.0) is None
    assert mc.knee_tokens([]) is None


def test_layer_reference_matches_per_token_experts():
    shape = mc.SHAPES["tiny"]
    layer = mc.Layer(shape, 1, "cpu", torch.float32)
    x = torch.randn(9, shape.hidden)
    w, ids = layer.route(x)
    got = layer.routed_reference(x, w, ids)
    for n in range(x.shape[0]):
        want = torch.zeros(shape.hidden)
        for k in range(shape.top_k):
            e = int(ids[n, k])
            a, b = (layer.w1[e] @ x[n]).chunk(2)
            want += w[n, k] * (layer.w2[e] @ (torch.nn.functional.silu(a) * b))
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-6)
    # an expert-parallel rank computes only its own experts' share
    half = mc.Layer(shape, 2, "cpu", torch.float32)
    assert half.w1.shape[0] == shape.experts // 2
    assert half.active_experts(x) <= shape.experts // 2


def test_cli_analytic_and_refusals(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert mc.main(["--analytic", "--tokens", "64,2048", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["rows"]] == [64, 2048]
    assert res["roofline_crossover_tokens"] == mc.crossover_tokens(DSV2)
    assert "compute-bound from T =" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not divide"):
        mc.main(["--analytic", "--ep", "3"])
    with pytest.raises(SystemExit, match="positive integers"):
        mc.main(["--analytic", "--tokens", "0,4"])
    with pytest.raises(SystemExit, match="comma-separated"):
        mc.main(["--analytic", "--tokens", "a"])


def test_routings_touch_the_experts_they_say():
    assert mc.expected_active_experts(64, 64, 6, "collapsed") == 6
    assert mc.expected_active_experts(4, 64, 6, "balanced") == 24
    assert mc.expected_active_experts(64, 64, 6, "balanced") == 64
    with pytest.raises(ValueError, match="unknown routing"):
        mc.expected_active_experts(4, 64, 6, "skewed")
    # vLLM's dummy weights on DeepSeek-V2 (collapsed): a tenth of the weight reads at batch 64
    uni, col = mc.roofline(DSV2, 64), mc.roofline(DSV2, 64, routing="collapsed")
    assert col.weight_bytes < uni.weight_bytes / 8
    assert mc.crossover_tokens(DSV2, routing="collapsed") < mc.crossover_tokens(DSV2) / 4
    # collapsed routing's k experts are all on rank 0 of an expert-parallel group
    ep2 = mc.roofline(DSV2, 64, ep=2, routing="collapsed")
    assert ep2.active_experts == 6 and ep2.flops > col.flops / 2


def test_layer_routings_on_cpu():
    shape = mc.SHAPES["tiny"]
    x = torch.randn(6, shape.hidden)
    col = mc.Layer(shape, 1, "cpu", torch.float32, routing="collapsed")
    _, ids = col.route(x)
    assert ids.tolist() == [[0, 1]] * 6
    bal = mc.Layer(shape, 1, "cpu", torch.float32, routing="balanced")
    _, ids = bal.route(x)
    assert ids.flatten().tolist() == [j % shape.experts for j in range(12)]
    assert bal.active_experts(x) == shape.experts
    with pytest.raises(ValueError, match="unknown routing"):
        mc.Layer(shape, 1, "cpu", torch.float32, routing="skewed")
