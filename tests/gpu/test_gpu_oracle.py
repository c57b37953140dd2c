"""GPU oracle: plain vLLM vs AFD on the same random-weight checkpoint (bf16).

Run on the GPU host after installing the offline bundle (scripts/gpu/run_gpu.sh):
    python3 -m pytest -m gpu tests/gpu

Connectors: `gloo` (TCP, stages activations through host memory, attention
forced eager), `cuda_ipc` (device-only exchange: eager and CUDA graphs on
the attention role, FFN-side graphs), and with two GPUs `nccl` (FFN on GPU 1).
Execution modes, each compared with plain vLLM run with the same flags:
eager; FULL_DECODE_ONLY CUDA graphs without torch.compile; the same with
torch.compile; model runner V1 and V2 (VLLM_USE_V2_MODEL_RUNNER); DBO
(--enable-dbo on the attention role, model runner V1), eager and with graphs
(plain vLLM cannot micro-batch at data-parallel size 1, so its reference runs
without DBO). Greedy tokens must be identical and top-5 logprobs within BF16_TOL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import oracle_lib
import pytest
import torch
from harness import AfdProc, afd_json, ffn_stopped_counts, free_afd_port

import serve_util as su
from vllm.afd.compat import HAS_V1_RUNNER, HAS_V2_UBATCH_RUNNER
from vllm.afd.dbo import RUNNER_MOVED

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
BF16_TOL = 0.05
MODELS_DIR = Path(os.environ.get("AFD_MODELS_DIR", HERE.parents[1] / "build" / "models"))
GPU_ARGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "4"]


def _env(gpu: int | str, runner: str | None = None) -> dict:
    """What a GPU engine adds to harness.AfdProc's environment (device "cuda": MLA on)."""
    env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    return env


def _proc(args, model, log, gpu, procs, runner=None, gpu_args=GPU_ARGS):
    """afd_proc.py with ``args`` (the mode first) on ``model``, on GPU(s) ``gpu``."""
    p = AfdProc(args[0], model, log, [*args[1:], *gpu_args], env=_env(gpu, runner),
                device="cuda")
    procs.append(p)
    return p


def _compare(plain: dict, afd: dict) -> float:
    return oracle_lib.assert_outputs_match(plain, afd, oracle_lib.PROMPTS["max_tokens"], BF16_TOL)


# With torch.compile the plain model's FFN is fused by Inductor while the FFN
# rank runs vLLM's eager kernels, so the two are not bitwise equal: logits may
# differ by a bf16 ulp (0.0625 at magnitudes 8-16). Measured 2026-12-01 on one
# H200 (qwen3_moe, 10 prompts): max |logprob diff| 0.063; greedy tokens
# diverged only where plain vLLM's top two logprobs were tied (margin 0.0).
COMPILE_TOL = 0.1


START = 300
# FULL_DECODE_ONLY graphs for decode batches up to 4 sequences (max_num_seqs).
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}
COMPILED_GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}
MODES = {"eager": None, "graphs": GRAPHS, "compiled-graphs": COMPILED_GRAPHS}

# The model runner of the cases that do not compare runners: V1 where the installed vLLM
# has it (up to 0.33.0), else V2 (0.34.0 deleted V1).
RUNNER = "v1" if HAS_V1_RUNNER else "v2"

NO_V1 = pytest.mark.skipif(not HAS_V1_RUNNER, reason="this vLLM line has no model runner V1")
ONE_GPU = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")

# (connector, FFN GPU, mode, model runner); a case this host or vLLM line cannot run is
# skipped with its reason
CASES = [
    ("gloo", 0, "eager", None),
    pytest.param("cuda_ipc", 0, "eager", "v1", marks=NO_V1),
    ("cuda_ipc", 0, "eager", "v2"),
    pytest.param("cuda_ipc", 0, "graphs", "v1", marks=NO_V1),
    ("cuda_ipc", 0, "graphs", "v2"),
    pytest.param("nccl", 1, "eager", None, marks=ONE_GPU),
    # FFN rank on GPU 1: inboxes in the other GPU's memory, over NVLink
    pytest.param("cuda_ipc", 1, "graphs", RUNNER, marks=ONE_GPU),
]

_PLAIN: dict[tuple, dict] = {}


def _mode_args(mode: str) -> list[str]:
    cc = MODES[mode]
    return [] if cc is None else ["--compilation-config", json.dumps(cc)]


def _plain(name, mode, runner, tmp_path, procs) -> dict:
    key = (name, mode, runner)
    if key not in _PLAIN:
        model = MODELS_DIR / name
        tmp_path.mkdir(parents=True, exist_ok=True)
        prompts = oracle_lib.write_prompts(tmp_path)
        out = tmp_path / "plain.json"
        plain = _proc(["plain", "--prompts", str(prompts), "--out", str(out), *_mode_args(mode)],
                      model, tmp_path / "plain.log", 0, procs, runner)
        _PLAIN[key] = plain.output(START)
    return _PLAIN[key]


def _afd(name, connector, ffn_gpu, mode, runner, tmp_path, procs, extra=None,
         attn_args=(), keep_ffn=None, num_attention=1, gpu_args=GPU_ARGS,
         ffn_group=1, ffn_args=()):
    """Start an FFN server and `num_attention` attention ranks (rank r writes
    afd_{r}.json, logs attn_{r}.log), wait for every attention rank; the output of
    each, in rank order, or the only one's with one attention rank. ffn_group > 1:
    the FFN server runs that many FFN ranks as its workers (pass its
    --tensor-parallel-size in ffn_args, and its GPUs as ffn_gpu)."""
    model = MODELS_DIR / name
    prompts = oracle_lib.write_prompts(tmp_path)
    port = free_afd_port(3)
    # Device waits give up after timeout_s: keep a broken run short.
    kw = {"connector": connector, "timeout_s": 30, **(extra or {})}
    if num_attention > 1:
        kw.update(num_attention_ranks=num_attention, num_ffn_ranks=ffn_group)
    # The attention ranks on GPU 0; with cuda_ipc each side also sees the other's GPU.
    att_gpu = su.cuda_visible_devices("0", str(ffn_gpu), connector)
    ffn_vis = su.cuda_visible_devices(str(ffn_gpu), "0", connector)
    ffn = _proc(["ffn", "--afd", afd_json("ffn", port, **kw), *ffn_args],
                model, tmp_path / "ffn.log", ffn_vis, procs, gpu_args=gpu_args)
    attns = []
    for r in range(num_attention):
        rank = {"rank": r} if num_attention > 1 else {}
        out = tmp_path / f"afd_{r}.json"
        attn = _proc(["attention", "--afd", afd_json("attention", port, **kw, **rank),
                      "--prompts", str(prompts), "--out", str(out),
                      *_mode_args(mode), *attn_args],
                     model, tmp_path / f"attn_{r}.log", att_gpu, procs, runner,
                     gpu_args=gpu_args)
        attns.append((attn, out))
    for attn, _ in attns:
        assert attn.wait(START) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    if keep_ffn is not None:
        keep_ffn.append(ffn)
    outs = [json.loads(out.read_text()) for _, out in attns]
    return outs[0] if num_attention == 1 else outs


def _attn_log(tmp_path, rank: int = 0) -> str:
    return (tmp_path / f"attn_{rank}.log").read_text(errors="replace")


def _ffn_log(tmp_path) -> str:
    return (tmp_path / "ffn.log").read_text(errors="replace")


@pytest.mark.parametrize("connector,ffn_gpu,mode,runner", CASES)
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2_mla"])
def test_gpu_oracle_1a1f(name, connector, ffn_gpu, mode, runner, tmp_path, procs):
    plain = _plain(name, mode, runner, tmp_path / "plain", procs)
    afd = _afd(name, connector, ffn_gpu, mode, runner, tmp_path, procs)
    worst = _compare(plain, afd)
    attn_log = _attn_log(tmp_path)
    if connector == "cuda_ipc":
        assert "running eager" not in attn_log  # gloo/nccl are forced eager, with a warning
        # Decode steps repeat their sizes: the FFN rank captures and replays them.
        assert "captured a CUDA graph for step" in _ffn_log(tmp_path)
    if mode != "eager":  # the attention captured its graphs with the remote-FFN op inside
        assert "Capturing CUDA graphs" in attn_log
    print(f"ORACLE {name} {connector} {mode} runner={runner or 'default'}: tokens identical, "
          f"max |logprob diff| {worst:.3g}")


@pytest.mark.parametrize("name", ["qwen3_moe"])
def test_gpu_oracle_compiled_graphs(name, tmp_path, procs):
    """torch.compile + FULL_DECODE_ONLY: the remote-FFN op stays opaque."""
    plain = _plain(name, "compiled-graphs", RUNNER, tmp_path / "plain", procs)
    afd = _afd(name, "cuda_ipc", 0, "compiled-graphs", RUNNER, tmp_path, procs)
    total = sum(oracle_lib.PROMPTS["max_tokens"])
    # a tie taken the other way ends its prompt's comparison: most tokens must be compared
    divs, worst, equal = oracle_lib.near_tie_divergences(plain, afd, COMPILE_TOL, COMPILE_TOL,
                                                         min_equal=total // 2)
    print(f"ORACLE {name} cuda_ipc compiled-graphs runner={RUNNER}: {equal} of {total} tokens "
          f"equal before {len(divs)} near-tie divergence(s), max |logprob diff| {worst:.3g}")


def test_gpu_oracle_router_on_attention(tmp_path, procs):
    """Router logits travel with the hidden states through the device inboxes."""
    name = "qwen3_moe"
    plain = _plain(name, "graphs", RUNNER, tmp_path / "plain", procs)
    afd = _afd(name, "cuda_ipc", 0, "graphs", RUNNER, tmp_path, procs,
               extra={"compute_gate_on_attention": True})
    worst = _compare(plain, afd)
    # the router ran on the attention side (2 of the checkpoint's 3 layers are MoE)
    assert "router of 2 MoE layer(s) runs on the attention role" in _attn_log(tmp_path)
    print(f"ORACLE {name} cuda_ipc graphs gate-on-attention: tokens identical, "
          f"max |logprob diff| {worst:.3g}")


def test_gpu_ffn_graphs_off_same_output(tmp_path, procs):
    """The FFN-side graph cache changes nothing but speed."""
    name = "qwen3_moe"
    plain = _plain(name, "graphs", RUNNER, tmp_path / "plain", procs)
    afd = _afd(name, "cuda_ipc", 0, "graphs", RUNNER, tmp_path, procs,
               extra={"connector_extra_config": {"ffn_cuda_graphs": False}})
    _compare(plain, afd)
    assert "captured a CUDA graph" not in _ffn_log(tmp_path)


# Prefill and decode steps of at least 2 tokens are micro-batched (prefills run eagerly,
# also with FULL_DECODE_ONLY graphs), on each model runner of the installed vLLM that
# micro-batches: V1 up to 0.33.0 (Qwen3-MoE's FLASH_ATTN needs patch ubatch-metadata-cache there), V2 from
# 0.32.0 on (vllm.afd.dbo_v2 through the target's hook patch; the only runner of 0.34.0).
DBO_RUNNERS = ["v1"] * HAS_V1_RUNNER + ["v2"] * HAS_V2_UBATCH_RUNNER


@pytest.mark.parametrize("runner", DBO_RUNNERS)
@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("name", ["deepseek_v2_mla", "qwen3_moe"])
def test_gpu_oracle_dbo(name, mode, runner, tmp_path, procs):
    """--enable-dbo: steps of at least 2 tokens run as two micro-batches whose
    exchanges run on their own streams (cuda_ipc slots); with graphs the
    attention captures micro-batched FULL decode graphs and the FFN rank one
    graph per micro-batched step."""
    plain = _plain(name, mode, runner, tmp_path / "plain", procs)
    ffns: list = []
    afd = _afd(name, "cuda_ipc", 0, mode, runner, tmp_path, procs, keep_ffn=ffns,
               attn_args=["--enable-dbo", "--dbo-threshold", "2"])
    worst = _compare(plain, afd)
    attn_log = _attn_log(tmp_path)
    assert "running eager" not in attn_log
    # The runner asked for is the one that micro-batched (V2: vllm.afd.dbo_v2's runner).
    assert ("AFD attention role: DBO on model runner V2" in attn_log) == (runner == "v2")
    counts = ffn_stopped_counts(ffns[0])
    # 4 sequences at a time: most steps have >= 2 tokens and are micro-batched.
    assert counts["ubatched"] > counts["steps"] // 2, counts
    if mode == "graphs":
        assert "Capturing CUDA graphs" in attn_log
        assert "captured a CUDA graph for step ('ubatched'" in _ffn_log(tmp_path)
    print(f"ORACLE {name} cuda_ipc {mode} DBO runner={runner}: tokens identical, "
          f"max |logprob diff| {worst:.3g}, {counts}")


# M:N on one GPU (2A1F and 3A1F, the topologies that fit one GPU): every process on GPU 0
# (correctness only - the processes time-slice the GPU), cuda_ipc, FULL decode graphs.
# Each attention process is an engine of its own and sizes its KV cache by profiling,
# which counts what the other processes allocate meanwhile as its own: with 3 attention
# engines starting at once, one found no memory left for the cache (measured 2026-12-02,
# deepseek_v2_mla 3A1F). A fixed KV cache size (vLLM's --kv-cache-memory-bytes, meant
# for GPUs shared between instances) takes the profile out of the sizing.
MN_GPU_ARGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.12", "--max-num-seqs", "4",
               "--kv-cache-memory-bytes", str(256 << 20)]


@pytest.mark.parametrize("num_attention", [2, 3])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2_mla"])
def test_gpu_oracle_m_attention_ranks_one_ffn_rank(name, num_attention, tmp_path, procs):
    """nA1F: each attention rank's output equals plain vLLM's (the FFN rank keeps one
    inbox row per attention rank and batches the ranks that are ready)."""
    mode = "graphs"
    plain = _plain(name, mode, RUNNER, tmp_path / "plain", procs)
    ffns: list = []
    outs = _afd(name, "cuda_ipc", 0, mode, RUNNER, tmp_path, procs, keep_ffn=ffns,
                num_attention=num_attention, gpu_args=MN_GPU_ARGS)
    worst = max(_compare(plain, out) for out in outs)
    for r in range(num_attention):
        assert "Capturing CUDA graphs" in _attn_log(tmp_path, r)
    # Steps served, and how many carried more than one attention rank's tokens.
    counts = ffn_stopped_counts(ffns[0])
    print(f"ORACLE {name} cuda_ipc {mode} {num_attention}A1F on one GPU: tokens identical on "
          f"every attention rank, max |logprob diff| {worst:.3g}, {counts}")


def test_gpu_oracle_2a1f_pingpong(tmp_path, procs):
    """ffn_schedule pingpong over cuda_ipc: the FFN rank serves the two ranks' steps
    interleaved layer by layer, captured as one CUDA graph per ordered pair of ranks and
    replayed; each rank's output equals plain vLLM's (its FFN work is what it would be
    served alone)."""
    name, mode = "deepseek_v2_mla", "graphs"
    plain = _plain(name, mode, RUNNER, tmp_path / "plain", procs)
    ffns: list = []
    outs = _afd(name, "cuda_ipc", 0, mode, RUNNER, tmp_path, procs, keep_ffn=ffns,
                num_attention=2, gpu_args=MN_GPU_ARGS,
                extra={"connector_extra_config": {"ffn_schedule": "pingpong"}})
    worst = max(_compare(plain, out) for out in outs)
    counts = ffn_stopped_counts(ffns[0])
    log = _ffn_log(tmp_path)
    assert counts["pingpong"] > 0 and counts["batched"] == 0, counts
    assert "captured a CUDA graph for step ('pingpong', (" in log, log[-3000:]
    print(f"ORACLE {name} cuda_ipc {mode} 2A1F pingpong on one GPU: tokens identical on "
          f"both ranks, max |logprob diff| {worst:.3g}, {counts}")


# nixl on one GPU, both roles on GPU 0 (under MPS with MPS=1): its device path (VRAM
# inboxes; the attention role's exchanges are kernels that a host proxy posts as NIXL
# writes), FULL decode graphs on the attention role, the FFN rank's host loop replaying
# graphs of each layer's block (ffn_layer_graphs). One plain reference for the three cases
# (the cache above).
NIXL_CASES = {
    "1a1f": {},
    "dbo": {"attn_args": ["--enable-dbo", "--dbo-threshold", "2"]},
    "2a1f": {"num_attention": 2, "gpu_args": MN_GPU_ARGS},
}


@pytest.mark.parametrize("case", list(NIXL_CASES))
def test_gpu_oracle_nixl(case, tmp_path, procs):
    name, mode = "deepseek_v2_mla", "graphs"
    plain = _plain(name, mode, RUNNER, tmp_path / "plain", procs)
    ffns: list = []
    outs = _afd(name, "nixl", 0, mode, RUNNER, tmp_path, procs, keep_ffn=ffns,
                extra={"connector_extra_config": {"ffn_layer_graphs": True}},
                **NIXL_CASES[case])  # fmt: skip
    outs = outs if isinstance(outs, list) else [outs]
    worst = max(_compare(plain, out) for out in outs)
    for r in range(len(outs)):
        log = _attn_log(tmp_path, r)
        assert "running eager" not in log and "Capturing CUDA graphs" in log
        assert "nixl device path to FFN rank 0" in log
    assert "VRAM" in _ffn_log(tmp_path)  # the FFN rank's inboxes are device memory
    counts = ffn_stopped_counts(ffns[0])
    if case == "dbo":
        assert counts["ubatched"] > counts["steps"] // 2, counts
    # The FFN rank's host drives nixl: it replays graphs of the layers' blocks (each layer
    # at a token count it served before), not of whole steps.
    assert counts["graphs"] == 0 and counts["layer_graphs"] > counts["steps"], counts
    print(f"ORACLE {name} nixl {mode} {case} runner={RUNNER}: tokens identical, "
          f"max |logprob diff| {worst:.3g}, {counts}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an FFN group needs two GPUs")
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2_mla"])
def test_gpu_oracle_2a2f_ffn_group_expert_parallel(name, tmp_path, procs):
    """2A2F: one FFN server with --tensor-parallel-size 2 --enable-expert-parallel on
    GPUs 0 and 1 (FFN ranks 0 and 1, half of the experts each: vLLM's CUDA MoE kernels
    take the expert map), two attention ranks on GPU 0, connector gloo (an FFN group's
    connector in this release; the attention role runs eager). Each attention rank
    equals plain vLLM."""
    plain = _plain(name, "eager", RUNNER, tmp_path / "plain", procs)
    ffns: list = []
    outs = _afd(name, "gloo", "0,1", "eager", RUNNER, tmp_path, procs, extra={"timeout_s": 60},
                keep_ffn=ffns, num_attention=2, gpu_args=MN_GPU_ARGS, ffn_group=2,
                ffn_args=("--tensor-parallel-size", "2", "--enable-expert-parallel"))
    worst = max(_compare(plain, out) for out in outs)
    text = _ffn_log(tmp_path)
    for r in range(2):
        assert f"AFD FFN rank {r} of an FFN group of 2 (expert parallel)" in text, ffns[0].tail()
    print(f"ORACLE {name} gloo eager 2A2F FFN group (EP 2, GPUs 0 and 1): tokens identical on "
          f"both attention ranks, max |logprob diff| {worst:.3g}")


# DeepSeek-V2 as its released configs have it: q LoRA, group-limited routing (4 groups, top 2), two dense first
# layers and routed scaling 2.5 (deepseek_v2_qlora), MLA, 12 prompts of 1 to 311 tokens at
# once (oracle_lib.mixed_length_prompts), 32 greedy tokens. DBO runs attention and MoE on
# micro-batches, so its kernels see other batch sizes than plain vLLM's (MLA split-KV
# scheduling, MoE tile configs) and bf16 results are not bitwise equal: a greedy token may
# flip where plain's own top two are within a few bf16 ulps. This random-weight model's
# next-token distributions are flat: in fp32 (CPU), 26 of the 384 positions have plain's
# top two within 0.02 logprob and 116 within 0.1. The CPU oracle runs the same case exactly.
QLORA_TIE_TOL = 0.1  # plain's best minus the taken token's logprob at a divergence
QLORA_TOL = 0.1  # |logprob diff| of every shared top-5 token before a divergence
QLORA_GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}  # fmt: skip
QLORA_GPU_ARGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                  "--max-num-seqs", "12"]  # fmt: skip
QLORA_GPU = su.cuda_visible_devices("0", "0", "cuda_ipc")  # both roles on GPU 0


def _qlora_run(tag, model, tmp_path, procs, port=None, args=(), runner="first",
               afd_extra=None) -> dict:
    """plain vLLM (``port`` None) or an AFD attention rank (cuda_ipc to the FFN rank at
    ``port``, ``afd_extra`` added to its AFD config) on GPU 0: FULL_DECODE_ONLY graphs,
    the first model runner that micro-batches (V1 where vLLM has it, else V2: DBO_RUNNERS;
    ``runner`` None: the one vLLM picks), the mixed-length prompts; its output (``tag``.json,
    log ``tag``.log)."""
    mode, afd = "plain", []
    if port is not None:
        mode = "attention"
        afd = ["--afd", afd_json("attention", port, connector="cuda_ipc", timeout_s=30,
                                 **(afd_extra or {}))]  # fmt: skip
    out = tmp_path / f"{tag}.json"
    p = _proc([mode, *afd, "--prompts", str(tmp_path / "prompts.json"), "--out", str(out),
               "--compilation-config", json.dumps(QLORA_GRAPHS), *args],
              model, tmp_path / f"{tag}.log", QLORA_GPU, procs,
              DBO_RUNNERS[0] if runner == "first" else runner, gpu_args=QLORA_GPU_ARGS)
    assert p.wait(START) == 0, p.tail() + "\n--- ffn ---\n" + _ffn_log(tmp_path)[-4000:]
    return json.loads(out.read_text())


def test_gpu_oracle_dbo_grouped_routing_q_lora(tmp_path, procs):
    """AFD with DBO (decode threshold 2, prefill 12) equals plain vLLM token for token, or
    each prompt's first divergence is a near-tie in plain's distribution (reported); the same
    FFN server then serves an attention rank without DBO, which must equal plain."""
    model = MODELS_DIR / "deepseek_v2_qlora"
    spec = oracle_lib.mixed_length_prompts()
    oracle_lib.write_prompts(tmp_path, spec)
    (tmp_path / "ffn.log").touch()  # read in an attention rank's failure message
    plain = _qlora_run("plain", model, tmp_path, procs)
    port = free_afd_port(3)
    ffn = _proc(["ffn", "--afd", afd_json("ffn", port, connector="cuda_ipc", timeout_s=30)],
                model, tmp_path / "ffn.log", QLORA_GPU, procs, gpu_args=QLORA_GPU_ARGS)
    dbo = _qlora_run("attn_dbo", model, tmp_path, procs, port,
                     ("--enable-dbo", "--dbo-threshold", "2", "--dbo-prefill-threshold", "12"))
    total = sum(spec["max_tokens"])
    # a divergence ends its prompt's comparison: most tokens must be compared (384 of 384
    # were equal on one H200, docs/results/2026-12.md)
    divs, worst, equal = oracle_lib.near_tie_divergences(plain, dbo, QLORA_TIE_TOL, QLORA_TOL,
                                                         min_equal=total // 2)
    for i, pos, gap in divs:
        print(f"ORACLE deepseek_v2_qlora DBO divergence: prompt {i} "
              f"({oracle_lib.MIXED_LENGTHS[i]} tokens) at generated token {pos}, plain's "
              f"best minus the taken token's logprob {gap:.4f} (< {QLORA_TIE_TOL})")
    serial = _qlora_run("attn_serial", model, tmp_path, procs, port)
    worst_serial = oracle_lib.assert_outputs_match(plain, serial, spec["max_tokens"], BF16_TOL)
    counts = ffn_stopped_counts(ffn)
    assert counts["ubatched"] > counts["steps"] // 4, counts
    assert "captured a CUDA graph for step ('ubatched'" in _ffn_log(tmp_path)
    print(f"ORACLE deepseek_v2_qlora cuda_ipc graphs DBO (2 decode / 12 prefill) "
          f"runner={DBO_RUNNERS[0]}: "
          f"{equal} of {total} tokens equal before {len(divs)} near-tie divergence(s), "
          f"max |logprob diff| {worst:.3g}; without DBO tokens identical, max |logprob "
          f"diff| {worst_serial:.3g}; {counts}")


QLORA_DBO_FLAGS = ("--enable-dbo", "--dbo-threshold", "2", "--dbo-prefill-threshold", "12")


def test_gpu_oracle_dbo_unsplit_on_vllms_default_runner(tmp_path, procs):
    """DBO that splits no step computes what plain vLLM computes on the model runner it runs.
    As ``vllm serve`` runs them: the runner vLLM picks (no VLLM_USE_V2_MODEL_RUNNER), AFD's
    cost gate on "auto" with both roles on GPU 0 (it then splits no step), --enable-dbo with
    the decode threshold 2 and prefill threshold 12. vLLM runs DeepSeek-V2 on model runner V2
    by default, and --enable-dbo moves it to V1 where V2 has no DBO (0.26.0;
    vllm.afd.dbo.runner_moved_by_dbo): the attention rank must say so, equal plain vLLM on V1
    token for token, and may differ from plain vLLM on V2 only at near-ties of plain's own
    distribution (each printed with its logprob gap)."""
    model = MODELS_DIR / "deepseek_v2_qlora"
    spec = oracle_lib.mixed_length_prompts()
    oracle_lib.write_prompts(tmp_path, spec)
    (tmp_path / "ffn.log").touch()  # read in an attention rank's failure message
    plain = _qlora_run("plain_default", model, tmp_path, procs, runner=None)
    port = free_afd_port(3)
    ffn = _proc(["ffn", "--afd", afd_json("ffn", port, connector="cuda_ipc", timeout_s=30)],
                model, tmp_path / "ffn.log", QLORA_GPU, procs, gpu_args=QLORA_GPU_ARGS)
    dbo = _qlora_run("attn_dbo_unsplit", model, tmp_path, procs, port, QLORA_DBO_FLAGS,
                     runner=None, afd_extra={"dbo_min_tokens": "auto"})  # fmt: skip
    counts = ffn_stopped_counts(ffn)
    text = (tmp_path / "attn_dbo_unsplit.log").read_text()
    assert "DBO splits no step: the FFN rank computes on this GPU too" in text, text[-4000:]
    assert counts["ubatched"] == 0 and counts["steps"] > 0, counts
    moved = RUNNER_MOVED in text
    if HAS_V1_RUNNER and not HAS_V2_UBATCH_RUNNER:  # 0.26.0: runner V2 has no DBO
        assert moved, text[-4000:]
    if moved:  # the same runner as the DBO rank: identical
        same = _qlora_run("plain_v1", model, tmp_path, procs, runner="v1")
    else:
        same = plain
    worst_same = oracle_lib.assert_outputs_match(same, dbo, spec["max_tokens"], BF16_TOL)
    total = sum(spec["max_tokens"])
    divs, worst, equal = oracle_lib.near_tie_divergences(plain, dbo, QLORA_TIE_TOL, QLORA_TOL,
                                                         min_equal=total // 2)
    for i, pos, gap in divs:
        print(f"ORACLE deepseek_v2_qlora unsplit DBO vs plain on vLLM's default runner: "
              f"prompt {i} ({oracle_lib.MIXED_LENGTHS[i]} tokens) diverges at generated token "
              f"{pos}, plain's best minus the taken token's logprob {gap:.4f}")
    print(f"ORACLE deepseek_v2_qlora cuda_ipc graphs DBO unsplit (auto gate, one GPU) "
          f"runner {'V1 (moved by --enable-dbo)' if moved else 'unchanged'}: tokens identical "
          f"to plain on that runner (max |logprob diff| {worst_same:.3g}); against plain on "
          f"vLLM's default runner {equal} of {total} equal before {len(divs)} near-tie "
          f"divergence(s), max |logprob diff| {worst:.3g}; {counts}")
