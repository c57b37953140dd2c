"""vllm.afd.plan: the model read from HF configs, the roofline of a decode step, the
calibration from the project's benchmark JSONs, the AFD and colocated step models, the
search, the CLI and the validation against the project's one-GPU figures."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import moe_crossover as mc  # benchmarks/moe_crossover.py
import pytest

from vllm.afd import plan as P

REPO = Path(__file__).resolve().parents[3]
FIGURES = REPO / "benchmarks" / "plan_figures.json"

# ---------------------------------------------------------------- models from configs


@pytest.mark.parametrize("preset, total_b, active_b", [
    ("deepseek-v3", 671.0, 36.6),   # published: 671B total, 37B activated
    ("deepseek-v2-lite", 15.7, 2.45),  # 15.7B, 2.4B
    ("step3", 316.3, 37.9),          # the LLM of Step-3: 316B, 38B activated
    ("mixtral-8x22b", 140.6, 39.0),  # 141B, 39B
])  # fmt: skip
def test_presets_have_their_published_parameter_counts(preset, total_b, active_b):
    m = P.load_model(preset)
    assert m.total_params() / 1e9 == pytest.approx(total_b, abs=0.1)
    assert m.active_params() / 1e9 == pytest.approx(active_b, abs=0.1)


def test_deepseek_v2_lite_layer_by_hand():
    m = P.load_model("deepseek-v2-lite", layers=14)
    assert (m.layers, m.moe_layers, m.dense_layers) == (14, 13, 1)
    assert m.mla and m.kv_elems == 512 + 64
    # q 2048 x 16*192, kv_a 2048 x 576, kv_b 512 x 16*256, o 16*128 x 2048
    assert m.attention_params == 2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048
    assert m.expert_params == 3 * 2048 * 1408
    assert m.shared_params == 2 * 3 * 2048 * 1408
    assert m.kv_bytes_per_token() == 14 * 576 * 2
    # MLA decodes over the latent: QK over 576, PV over 512, per head, 2 FLOPs a MAC
    assert m.attn_flops_per_context_token == 2 * 16 * (512 + 576)


@pytest.mark.parametrize("cfg, moe_layers, expert_i, shared_i", [
    # Qwen3-MoE: mlp_only_layers dense, decoder_sparse_step
    ({"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2,
      "intermediate_size": 256, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
      "mlp_only_layers": [0]}, 3, 64, 0),
    # Qwen2-MoE: a shared expert of its own size
    ({"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
      "intermediate_size": 256, "moe_intermediate_size": 64, "decoder_sparse_step": 2,
      "shared_expert_intermediate_size": 128}, 2, 64, 128),
    # Mixtral: intermediate_size is the expert's
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
      "intermediate_size": 64}, 4, 64, 0),
    # Step-3: the MoE layers listed (vLLM's checkpoints write them as a string)
    ({"model_type": "step3_text", "moe_num_experts": 8, "moe_top_k": 2,
      "intermediate_size": 256, "moe_intermediate_size": 64, "share_expert_dim": 32,
      "share_q_dim": 64, "head_dim": 32, "num_attention_groups": 1,
      "moe_layers_enum": "1,2"}, 2, 64, 32),
    # Ernie-4.5: a range of MoE layers
    ({"model_type": "ernie4_5_moe", "moe_num_experts": 8, "moe_k": 2,
      "intermediate_size": 256, "moe_intermediate_size": 64, "moe_num_shared_experts": 1,
      "moe_layer_start_index": 1, "moe_layer_end_index": 2}, 2, 64, 64),
    # Llama 4: every second layer MoE, a shared expert, a dense MLP of its own size
    ({"model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1,
      "intermediate_size": 64, "intermediate_size_mlp": 256,
      "interleave_moe_layer_step": 2}, 2, 64, 64),
    # a dense model
    ({"model_type": "llama", "intermediate_size": 256}, 0, 256, 0),
])  # fmt: skip
def test_families_moe_layers_and_expert_sizes(cfg, moe_layers, expert_i, shared_i):
    base = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 607}
    m = P.Model.from_hf_config({**base, **cfg})
    assert (m.moe_layers, m.expert_intermediate, m.shared_intermediate) == (
        moe_layers, expert_i, shared_i)


def test_step3_attention_is_a_low_rank_query_over_one_kv_head():
    m = P.load_model("step3")
    assert (m.mla, m.kv_heads, m.head_dim, m.q_lora_rank) == (False, 1, 256, 2048)
    assert m.kv_elems == 2 * 256
    # qkv 7168 x (2048 + 2*256), wq 2048 x 64*256, o 64*256 x 7168
    assert m.attention_params == 7168 * 2048 + 2048 * 64 * 256 + 2 * 7168 * 256 + 64 * 256 * 7168
    assert (m.moe_layers, m.weight_bytes, m.kv_bytes) == (56, 1.0, 2.0)  # fp8 weights


def test_bad_configs_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        P.Model.from_hf_config({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="no top-k"):
        P.Model.from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8,
                                "num_attention_heads": 2, "num_experts": 4})
    with pytest.raises(ValueError, match="layers 30 > the config's 27"):
        P.load_model("deepseek-v2-lite", layers=30)
    with pytest.raises(ValueError, match="not a preset"):
        P.load_model(str(tmp_path / "none"))
    (tmp_path / "config.json").write_text(json.dumps(P.PRESETS["mixtral-8x22b"]))
    assert P.load_model(str(tmp_path)).experts == 8  # a directory holding config.json


# ----------------------------------------------------------------- the roofline


def test_active_experts():
    assert P.active_experts(1, 64, 6) == pytest.approx(6)
    assert P.active_experts(10_000, 64, 6) == pytest.approx(64)
    assert P.active_experts(10, 64, 6, "balanced") == 60
    assert P.active_experts(11, 64, 6, "balanced") == 64
    assert P.active_experts(500, 64, 6, "collapsed") == 6
    with pytest.raises(ValueError, match="unknown routing"):
        P.active_experts(1, 64, 6, "skewed")


def test_moe_layer_agrees_with_moe_crossover():
    """Two codes of the same layer: the planner's and benchmarks/moe_crossover.py's."""
    m = P.load_model("deepseek-v2-lite")
    for t in (16, 64, 1024, 4096):
        w = P.moe_layer_work(m, t)
        r = mc.roofline(mc.SHAPES["deepseek-v2-lite"], t)
        assert w.gemm_flops == pytest.approx(r.flops)
        # the planner also counts the shared experts' intermediate activations
        shared_acts = t * 3 * m.shared_intermediate * 2
        assert w.bytes - r.act_bytes - shared_acts == pytest.approx(r.weight_bytes)


def test_one_gpu_bounds_of_the_m_to_n_configurations():
    """The three ways of serving 2 x 64 sequences on one H100: one engine of 128 reads the
    weights once, two replicas twice, AFD 2A1F the attention twice and the FFN once (twice
    with the ranks' steps interleaved, ffn_schedule pingpong)."""
    m = P.load_model("deepseek-v2-lite", layers=14)
    h100 = P.CARDS["h100"]
    ctx = 64 + 48
    one = P.step_bound(m, h100, "plain_one", 2, 64, ctx, "balanced")
    reps = P.step_bound(m, h100, "plain", 2, 64, ctx, "balanced")
    afd = P.step_bound(m, h100, "afd", 2, 64, ctx, "balanced")
    wb = 2
    experts = 13 * 64 * 3 * 2048 * 1408 * wb
    shared_router = 13 * (2 * 3 * 2048 * 1408 + 2048 * 64) * wb
    dense = 3 * 2048 * 10944 * wb
    attn = 14 * m.attention_params * wb
    head = 2048 * 102400 * wb
    kv = 128 * ctx * 14 * 576 * wb
    weights = experts + shared_router + dense + attn + head
    # the second replica reads every weight again; AFD's second rank its attention and head
    assert reps.bytes - one.bytes == pytest.approx(weights)
    assert afd.bytes - one.bytes == pytest.approx(attn + head)
    # ffn_schedule pingpong: each rank's step is a pass of its own, reading the FFN's
    # weights again (64 balanced tokens touch every expert): a replica's bytes, nearly
    pingpong = P.step_bound(m, h100, "afd_pingpong", 2, 64, ctx, "balanced")
    assert pingpong.bytes - afd.bytes == pytest.approx(experts + shared_router + dense)
    assert pingpong.bytes == pytest.approx(reps.bytes, rel=0.01)
    # the rest of one engine's bytes: activations, logits, embedding rows (under 2%)
    assert 0 < one.bytes - weights - kv < 0.02 * one.bytes
    for b in (one, reps, afd, pingpong):
        assert b.limit == "memory" and b.tokens == 128
        assert b.step_s == pytest.approx(b.bytes / 3.35e12)
        assert b.tok_s == pytest.approx(128 / b.step_s)
    # the figures measured on one H100 read as fractions of these bounds
    assert one.step_s / 7.09e-3 == pytest.approx(0.686, abs=0.01)
    assert reps.step_s / 12.12e-3 == pytest.approx(0.790, abs=0.01)
    assert afd.step_s / 8.23e-3 == pytest.approx(0.620, abs=0.01)


def test_bound_of_roles_on_two_gpus_is_the_busier_one():
    m = P.load_model("deepseek-v2-lite")
    same = P.step_bound(m, P.CARDS["h200"], "afd", 1, 64, 128, "balanced", same_gpu=True)
    two = P.step_bound(m, P.CARDS["h200"], "afd", 1, 64, 128, "balanced", same_gpu=False)
    ffn = P.ffn_work(m, 64, 1, "balanced")
    assert two.bytes == pytest.approx(ffn.bytes)
    assert two.step_s < same.step_s


def test_compute_bound_at_large_batches_and_fp8_rate():
    m = P.load_model("deepseek-v2-lite")
    w = P.engine_work(m, 8192, 128)
    card = P.CARDS["h200"]
    assert P.compute_seconds(w, card, P.ROOFLINE) > P.memory_seconds(w, card, P.ROOFLINE)
    fp8 = replace(m, weight_bytes=1.0)
    wf = P.engine_work(fp8, 8192, 128)
    assert P.compute_seconds(wf, card, P.ROOFLINE, 1.0) == pytest.approx(
        wf.gemm_flops / 1979e12 + wf.attn_flops / 989e12)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"),
    ("NVIDIA H800", "h800"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None), ("cpu", None),
])  # fmt: skip
def test_card_for_device(name, key):
    assert P.card_for_device(name) == key


# ------------------------------------------------------------------ calibration


def test_fit_moe_layer_recovers_the_efficiencies_of_synthetic_times():
    m = P.load_model("deepseek-v2-lite")
    card = P.CARDS["h200"]
    for p in (math.inf, 2.0, 3.0):
        truth = replace(P.ROOFLINE, mem_eff=0.7, flop_eff=0.4, overlap_p=p)
        pts = [(t, 1e6 * P.seconds(P.moe_layer_work(m, t), card, truth)) for t in
               (16, 64, 256, 1024, 2048, 4096, 16384)]
        mem, flop, got_p = P.fit_moe_layer(m, card, pts)
        assert (mem, flop, got_p) == pytest.approx((0.7, 0.4, p))


def test_combine_is_the_max_or_a_p_norm():
    assert P.combine(3.0, 4.0) == 4.0
    assert P.combine(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert P.combine(0.0, 0.0, 2.0) == 0.0
    m = P.load_model("deepseek-v2-lite")
    w = P.moe_layer_work(m, 1024)
    card = P.CARDS["h200"]
    cal = replace(P.ROOFLINE, overlap_p=2.0)
    assert P.seconds(w, card, cal) > P.seconds(w, card, P.ROOFLINE)  # near the crossover


def test_fit_step_overhead_fixed_and_per_sequence():
    m = P.load_model("deepseek-v2-lite")
    card, cal = P.CARDS["h200"], replace(P.ROOFLINE, mem_eff=0.7)

    def tpot(b):
        return P.seconds(P.engine_work(m, b, 128), card, cal) + (500 + 3.0 * b) * 1e-6

    fixed, per = P.fit_step_overhead(m, card, cal, [(b, 128, tpot(b)) for b in (16, 64, 256)])
    assert (fixed, per) == pytest.approx((500.0, 3.0))
    fixed, per = P.fit_step_overhead(m, card, cal, [(64, 128, tpot(64))])
    assert (fixed, per) == pytest.approx((500 + 3.0 * 64, 0.0))  # one batch: the fixed part


def test_calibration_from_the_benchmarks_json(tmp_path):
    card = P.CARDS["h100"]
    shape = mc.SHAPES["deepseek-v2-lite"]
    # a moe_crossover --json whose layer ran at 2.5 TB/s at T=64 and 300 TFLOP/s at 4096
    rows = []
    for t in (64, 4096):
        r = mc.roofline(shape, t)
        s = max((r.weight_bytes + r.act_bytes) / 2.5e12, r.flops / 300e12)
        rows.append({"tokens": t, "layer_us": s * 1e6})
    crossover = {"shape": "deepseek-v2-lite", "hidden": 2048, "moe_intermediate": 1408,
                 "experts": 64, "top_k": 6, "shared": 2, "ep": 1, "routing": "uniform",
                 "dtype": "bfloat16", "rows": rows}
    cal = P.calibration_from_json(crossover, card, P.ROOFLINE, "mc.json")
    assert cal.mem_eff == pytest.approx(2.5 / 3.35, rel=0.01)
    assert cal.flop_eff == pytest.approx(300 / 989, rel=0.02)
    assert cal.overlap_p == math.inf  # two points, each bound by one side: the max fits
    handover = {"sharing": "one GPU, MPS", "args": {"layers": 27}, "results": {"attention": {
        "split/16": {"step_us": 4.7 * 54}, "split/64": {"step_us": 4.8 * 54},
        "split/256": {"step_us": 5.2 * 54}, "fused/64": {"step_us": 99.0}}}}
    cal = P.calibration_from_json(handover, card, cal, "h.json")
    assert cal.handover_us == pytest.approx(4.8)
    assert cal.sources == ("spec sheet", "mc.json", "h.json")
    cal = P.calibration_from_json({"step_overhead_us": 700, "card": "h100"}, card, cal)
    assert cal.step_overhead_us == 700 and cal.mem_eff == pytest.approx(2.5 / 3.35, rel=0.01)
    with pytest.raises(ValueError, match="'mem_efficiency'"):
        P.calibration_from_json({"mem_efficiency": 0.5}, card, cal, "x.json")
    with pytest.raises(ValueError, match="--analytic"):
        P.calibration_from_json({**crossover, "rows": [{"tokens": 64}]}, card, cal)


# ----------------------------------------------------------- deployments and search


def toy_cluster(**kw) -> P.Cluster:
    card = P.Card("toy", hbm_tbs=1.0, bf16_tflops=1e9, fp8_tflops=1e9, memory_gb=1000.0,
                  nvlink_gbs=1e9, net_gbs=1e9, nvlink_latency_us=0.0, net_latency_us=0.0)
    return P.Cluster(card, **kw)


def test_ping_pong_cycle():
    """m micro-batches: a layer takes max(m ta, m tf, ta + tf + 2 tc); with free links and
    compute, each side's time is its bytes."""
    m = P.load_model("deepseek-v2-lite")
    cl = toy_cluster()
    for mb in (1, 2, 3):
        d = P.afd_deployment(m, cl, P.ROOFLINE, 2, 2, 96, mb, 128, "balanced")
        s = 96 / mb
        ta = P.attention_layers_work(m, s, 128).bytes / m.layers / 1e12
        tf = P.ffn_work(m, 2 * s, 2, "balanced").bytes / m.layers / 1e12
        assert (d.attention_s, d.ffn_s) == pytest.approx((ta, tf))
        head = mb * P.head_work(m, s).bytes / 1e12
        cycle = max(mb * ta, mb * tf, ta + tf + 2 * d.link_s)
        assert d.tpot_s == pytest.approx(m.layers * cycle + head)
        assert d.tok_s_per_gpu == pytest.approx(2 * 96 / d.tpot_s / 4)
    # one micro-batch: serial, each side idle while the other works
    d1 = P.afd_deployment(m, cl, P.ROOFLINE, 2, 2, 96, 1, 128, "balanced")
    assert d1.tpot_s == pytest.approx(m.layers * (d1.attention_s + d1.ffn_s + 2 * d1.link_s)
                                      + P.head_work(m, 96).bytes / 1e12)


def test_tensor_parallel_attention_splits_weights_and_the_kv_heads():
    mixtral = P.load_model("mixtral-8x22b")  # 8 KV heads
    w1 = P.attention_gpu_work(mixtral, 64, 1024, 1)
    w8 = P.attention_gpu_work(mixtral, 64, 1024, 8)
    weights = mixtral.layers * mixtral.attention_params * 2
    kv = 64 * 1024 * mixtral.kv_bytes_per_token()
    assert w1.bytes - w8.bytes == pytest.approx(weights * 7 / 8 + kv * 7 / 8)
    assert w8.attn_flops == pytest.approx(w1.attn_flops / 8)
    dsv3 = P.load_model("deepseek-v3")  # MLA: every GPU reads the whole latent
    kv3 = 64 * 1024 * dsv3.kv_bytes_per_token()
    d1, d8 = P.attention_gpu_work(dsv3, 64, 1024, 1), P.attention_gpu_work(dsv3, 64, 1024, 8)
    assert d1.bytes - d8.bytes == pytest.approx(dsv3.layers * dsv3.attention_params * 7 / 8)
    assert d8.bytes > kv3


def test_tp_deployment_step_and_throughput():
    m = P.load_model("mixtral-8x22b")
    cl = P.Cluster(P.CARDS["a100"])
    cal = P.H200_MEASURED
    d = P.tp_deployment(m, cl, cal, 16, 8, 256, 1024)
    ar = P.allreduce_seconds(cl, cal, 8, 256, m.hidden, 2)
    assert ar == pytest.approx(5e-6 + 2 * 7 / 8 * 256 * 6144 * 2 / 300e9)
    assert d.link_s == pytest.approx(2 * ar)
    head = P.seconds(P.head_work(m, 256) * (1 / 8), cl.card, cal)
    assert d.tpot_s == pytest.approx(m.layers * (d.attention_s + d.ffn_s + d.link_s) + head
                                     + cal.overhead_s(0, 256))
    assert d.tok_s_per_gpu == pytest.approx(2 * 256 / d.tpot_s / 16)  # two replicas of TP8
    assert d.ratio == "TP8"
    assert d.attention_mem_gb == pytest.approx(
        ((m.attention_weight_bytes() + m.ffn_weight_bytes()) / 8
         + 256 * 1024 * m.kv_bytes_per_token() / 8) / 1e9)


def test_afd_with_tensor_parallel_attention_groups():
    m = P.load_model("mixtral-8x22b")
    cl = P.Cluster(P.CARDS["a100"])
    d = P.afd_deployment(m, cl, P.ROOFLINE, 8, 8, 128, 2, 1024, attention_tp=4)
    assert d.ratio == "8:8 TP4"
    assert d.tok_s == pytest.approx(2 * 128 / d.tpot_s)  # two groups of 128 sequences
    # the FFN sees both groups' micro-batch: 2 x 64 tokens
    tf = P.seconds(P.ffn_work(m, 128, 8) * (1 / m.layers), cl.card, P.ROOFLINE)
    assert d.ffn_s == pytest.approx(tf)
    with pytest.raises(ValueError, match="groups of 3"):
        P.afd_deployment(m, cl, P.ROOFLINE, 8, 8, 128, 2, 1024, attention_tp=3)


def test_hand_over_time_and_links():
    m = P.load_model("deepseek-v2-lite")
    card = P.CARDS["h200"]
    cl = P.Cluster(card)
    d = P.afd_deployment(m, cl, P.ROOFLINE, 2, 2, 64, 1, 128)
    fan = 2 * (1 - 0.5 ** 6)  # a token's 6 experts on one or both FFN GPUs
    sent = 64 * 2048 * 2 * fan
    assert d.link_s == pytest.approx(5e-6 + sent / 450e9)  # one host: NVLink
    far = P.afd_deployment(m, cl, P.ROOFLINE, 8, 8, 64, 1, 128)
    got = 8 * 64 * (8 * (1 - (7 / 8) ** 6)) / 8 * 2048 * 2
    assert far.link_s == pytest.approx(10e-6 + got / 50e9)  # 16 GPUs: the NIC
    t, lat = cl.all_to_all_seconds(1e9, 16)
    assert t == pytest.approx(max(1e9 * 7 / 15 / 450e9, 1e9 * 8 / 15 / 50e9))
    assert lat == pytest.approx(10e-6)


def test_plan_meets_its_target_and_memory():
    m = P.load_model("deepseek-v3")
    cl = P.Cluster(P.CARDS["h200"])
    pl = P.plan(m, cl, P.H200_MEASURED, 16, 0.05, 4096)
    usable = cl.usable_bytes()
    for d in [pl.afd, pl.colocated, *pl.afd_by_ratio]:
        assert d is not None and d.tpot_s <= 0.05
        assert d.attention_mem_gb * 1e9 <= usable and d.ffn_mem_gb * 1e9 <= usable
    assert pl.afd.attention_gpus + pl.afd.ffn_gpus == 16
    assert pl.afd.tok_s_per_gpu == max(d.tok_s_per_gpu for d in pl.afd_by_ratio)
    assert pl.gain == pytest.approx(pl.afd.tok_s_per_gpu / pl.colocated.tok_s_per_gpu)
    # a batch one step larger breaks the target or memory (the search went to the limit)
    grid = P.batch_grid()
    nxt = grid[grid.index(pl.colocated.batch) + 1]
    d = P.colocated_deployment(m, cl, P.H200_MEASURED, 16, nxt, pl.colocated.micro_batches,
                               4096)
    assert d.tpot_s > 0.05 or d.attention_mem_gb * 1e9 > usable
    # DeepSeek-V3's 656 GB of experts in fp8 do not fit 4 H200s of FFN: no 12:4 split
    assert all(d.ffn_gpus > 4 for d in pl.afd_by_ratio)


def test_plan_with_nothing_that_fits():
    m = P.load_model("deepseek-v3")
    pl = P.plan(m, P.Cluster(P.CARDS["h100"]), P.H200_MEASURED, 2, 0.05, 4096)
    assert pl.afd is None and pl.colocated is None and pl.gain is None


def test_parse_context():
    assert P.parse_context("4096") == (4096.0, [(4096, 1.0)])
    mean, mix = P.parse_context("1024:0.75,8192:0.25")
    assert mean == pytest.approx(0.75 * 1024 + 0.25 * 8192) and len(mix) == 2
    with pytest.raises(ValueError, match="LEN or LEN:SHARE"):
        P.parse_context("4k")


# --------------------------------------------------------------------------- CLI


def test_cli_plans_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert P.main(["--model", "deepseek-v3", "--card", "h200", "--gpus", "8,16", "--tpot-ms",
                   "50", "--context", "4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "deepseek-v3: 61 layers (58 MoE, 256 experts top-8), 671.0B params" in text
    data = json.loads(out.read_text())
    assert [p["gpus"] for p in data["plans"]] == [8, 16]
    for p in data["plans"]:
        afd = p["afd"]
        assert afd["attention_gpus"] + afd["ffn_gpus"] == p["gpus"]
        assert afd["tpot_s"] <= 0.05
        assert p["gain"] == pytest.approx(afd["tok_s_per_gpu"]
                                          / p["colocated"]["tok_s_per_gpu"])


def test_cli_calibration_flags_and_refusals(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"mem_eff": 0.5, "flop_eff": 0.3}))
    assert P.main(["--model", "deepseek-v2-lite", "--card", "h100", "--gpus", "2",
                   "--tpot-ms", "30", "--calibration", str(cal), "--handover-us", "7"]) == 0
    assert "mem_eff 0.500 flop_eff 0.300" in capsys.readouterr().out
    for argv, msg in ((["--model", "deepseek-v3", "--card", "tpu"], "--card tpu"),
                      (["--model", "deepseek-v3", "--mem-eff", "1.5"], "mem_eff and flop_eff"),
                      (["--model", "deepseek-v3", "--gpus", "1"], "--gpus must be at least 2"),
                      ([], "--model is required")):
        with pytest.raises(SystemExit):
            P.main(argv)
        assert msg in capsys.readouterr().err


# ----------------------------------------------------------------- validation


def test_validation_against_the_one_gpu_figures(capsys):
    """`python -m vllm.afd.plan check benchmarks/plan_figures.json` gives the error
    docs/planner.md states; the default calibration is the one the file yields."""
    data = json.loads(FIGURES.read_text())
    rows = P.check_figures(data)
    checked = [abs(r["error"]) for r in rows if not r["calibration_point"]]
    assert len(checked) >= 20
    assert statistics.median(checked) == pytest.approx(0.054, abs=0.002)
    assert max(checked) == pytest.approx(0.314, abs=0.002)
    for r in rows:  # the calibration points are met, the others are predictions
        if r["calibration_point"] and r["engines"] == 2:
            assert r["error"] == pytest.approx(0.0, abs=1e-6)
    card, cal = P.check_calibrations(data)["h200-2026-12-06"]
    d = P.H200_MEASURED
    assert (d.mem_eff, d.flop_eff, d.shared_mem_eff, d.overlap_p) == pytest.approx(
        (cal.mem_eff, cal.flop_eff, cal.concurrent_mem_eff, cal.overlap_p), abs=0.001)
    assert (d.step_overhead_us, d.token_overhead_us, d.handover_us) == pytest.approx(
        (cal.step_overhead_us, cal.token_overhead_us, cal.handover_us), abs=0.5)
    assert P.main(["check", str(FIGURES)]) == 0
    assert "|error| median" in capsys.readouterr().out


def test_passes_per_round_from_ffn_counters():
    assert P.passes_per_round(2, 241, 195) == pytest.approx(2 * 241 / (46 + 2 * 195))
    assert P.passes_per_round(2, 100, 100) == 1.0  # every pass joined both ranks
    assert P.passes_per_round(2, 100, 0) == 2.0  # none did: one pass a rank
    with pytest.raises(ValueError, match="no FFN passes"):
        P.passes_per_round(2, 0, 0)
    m = P.load_model("deepseek-v2-lite")
    cal = P.H200_MEASURED
    joined = P.predict_one_gpu(m, P.CARDS["h200"], cal, "afd", 2, 64, 112, "balanced", 1.0)
    apart = P.predict_one_gpu(m, P.CARDS["h200"], cal, "afd", 2, 64, 112, "balanced", 2.0)
    assert apart > joined  # each pass reads every expert again
    with pytest.raises(ValueError, match="outside 1..2"):
        P.predict_one_gpu(m, P.CARDS["h200"], cal, "afd", 2, 64, 112, "balanced", 3.0)


def test_no_torch_or_vllm_import():
    """The planner is pure Python: its module imports nothing of torch or vLLM."""
    import ast

    src = Path(P.__file__).read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= {"__future__", "argparse", "json", "math", "statistics", "sys",
                     "collections", "dataclasses", "pathlib"}, names
    assert math.isfinite(P.H200_MEASURED.mem_eff)
