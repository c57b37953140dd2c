"""The CPU oracle: AFD output equals plain vLLM on the same checkpoint.

Greedy decoding in fp32: token ids must be identical and the top-5 logprobs
of every generated position within LOGPROB_TOL. Every engine runs in its own
process (tests/cpu/afd_proc.py through harness.AfdProc, in-process engine core
for speed).

The prompts (oracle_lib.PROMPTS) have different lengths with different max_tokens;
with max_num_seqs=4 the scheduler mixes prefills with decodes (continuous batching).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import harness
import pytest
from harness import AfdProc, afd_json, cpu_shm_files, ffn_stopped_counts
from harness import free_afd_port as free_port
from oracle_lib import (
    LOGPROB_TOL,
    PROMPTS,
    assert_outputs_match,
    mixed_length_prompts,
    write_prompts,
)

from vllm.afd import architectures

pytestmark = pytest.mark.cpu_e2e

START_TIMEOUT = 420  # engine start on a loaded 2-core machine


_PLAIN_CACHE: dict[str, dict] = {}


def start_plain(model: Path, tmp_path: Path, engine_args: tuple[str, ...] = ()) -> AfdProc:
    """A plain vLLM engine generating PROMPTS, in a folder of its own (an AFD pair started
    beside it rewrites tmp_path/prompts.json)."""
    own = tmp_path / f"plain_{model.name}"
    own.mkdir(exist_ok=True)
    return harness.start_plain(model, own, max_num_seqs=4, args=engine_args)


def plain_reference(model: Path, tmp_path: Path) -> dict:
    """Plain vLLM output for PROMPTS (computed once per model per test run)."""
    key = str(model)
    if key not in _PLAIN_CACHE:
        _PLAIN_CACHE[key] = start_plain(model, tmp_path).output(START_TIMEOUT)
    return _PLAIN_CACHE[key]


def plain_reference_beside(model: Path, tmp_path: Path, procs) -> Callable[[], dict]:
    """plain_reference's output, to be read once the AFD pair the test starts next has
    run: a reference not computed yet runs beside that pair (engine start-up is mostly one
    thread each, as in test_oracle_family), not before it."""
    key = str(model)
    if key not in _PLAIN_CACHE:
        p = start_plain(model, tmp_path)
        procs.append(p)

        def result() -> dict:
            if key not in _PLAIN_CACHE:
                _PLAIN_CACHE[key] = p.output(START_TIMEOUT)
            return _PLAIN_CACHE[key]

        return result
    return lambda: _PLAIN_CACHE[key]


def assert_matches(plain: dict, afd: dict) -> float:
    return assert_outputs_match(plain, afd, PROMPTS["max_tokens"], LOGPROB_TOL)


def run_afd(procs, tmp_path: Path, model: Path, *, attention_first=False,
            num_attention=1, extra: dict | None = None, attn_model: Path | None = None,
            attn_args: tuple[str, ...] = (), ffn_group: int = 1,
            attn_extra: dict | None = None, ffn_ready_first: bool = False,
            engine_args: tuple[str, ...] = (), together: bool = False,
            rank_args: dict[int, tuple[str, ...]] | None = None):
    """ffn_group > 1: one FFN server of that many tensor-parallel workers, FFN
    ranks 0..ffn_group-1 (an FFN group). attn_extra: --afd-config keys of the
    attention ranks only (timeouts: the handshake does not compare them).
    engine_args: afd_proc.py arguments of every engine (dtype, cache dtype).
    ffn_ready_first: start the attention ranks once the FFN server listens (their
    connect timeout then counts from their first attempt, not from the FFN's start).
    together: the attention ranks generate at once, when every one of them is up.
    rank_args: afd_proc.py arguments of one attention rank (by rank) beside attn_args."""
    extra = dict(extra or {})
    port = free_port(ffn_group)
    prompts = write_prompts(tmp_path)
    topo = {"num_attention_ranks": num_attention, "num_ffn_ranks": ffn_group, **extra}
    go = tmp_path / "generate"  # together: made once every attention rank is up
    group_args = ["--tensor-parallel-size", str(ffn_group)] if ffn_group > 1 else []

    def start_ffn():
        p = AfdProc("ffn", model, tmp_path / "ffn.log",
                    ["--afd", afd_json("ffn", port, **topo), *group_args, *engine_args])
        procs.append(p)
        return p

    def start_attn(rank: int):
        out = tmp_path / f"afd_{rank}.json"
        p = AfdProc("attention", attn_model or model, tmp_path / f"attn_{rank}.log",
                    ["--afd", afd_json("attention", port, rank=rank,
                                       **{**topo, **(attn_extra or {})}),
                     "--prompts", str(prompts), "--out", str(out), "--max-num-seqs", "4",
                     *(["--start-when", str(go)] if together else []),
                     *engine_args, *attn_args, *(rank_args or {}).get(rank, ())])
        procs.append(p)
        return p, out

    ffn = None if attention_first else start_ffn()
    if ffn_ready_first:
        assert ffn.wait_for_log("AFD-FFN-READY", START_TIMEOUT) is not None, ffn.tail()
    attns = [start_attn(r) for r in range(num_attention)]
    if attention_first:
        # The FFN server starts once every attention rank is up and trying to reach it.
        for attn, _ in attns:
            assert attn.wait_for_log("AFD: connecting to FFN rank", START_TIMEOUT) \
                is not None, attn.tail()
        ffn = start_ffn()
    if together:
        for attn, _ in attns:
            assert attn.wait_for_log("AFD-PROC-READY", START_TIMEOUT) is not None, attn.tail()
        go.touch()
    return ffn, attns


# The attention role opens each step at the model's forward (a pre-hook) rather than at
# its first remote layer; its token count must then equal that layer's (else an error).
EARLY_CONTROL = "AFD attention role: steps open at the model's forward"


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v2"])
def test_oracle_1a1f(name, models_dir, tmp_path, procs):
    model = models_dir / name
    plain = plain_reference_beside(model, tmp_path, procs)
    ffn, [(attn, out)] = run_afd(procs, tmp_path, model)
    assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    worst = assert_matches(plain(), json.loads(out.read_text()))
    assert EARLY_CONTROL in attn.text(), attn.tail()
    print(f"{name}: tokens identical, max |logprob diff| {worst:.2e}")
    assert ffn.p.poll() is None, "FFN server must keep serving after the attention goodbye"


# The MoE families of vllm.afd.architectures (docs/models.md), one 1A1F case each on a
# checkpoint of scripts/make_models.py: name -> (family, MoE layers of the checkpoint,
# afd_proc.py arguments of every engine besides the checkpoint's dtype). The router runs
# on the attention role where the family allows it (the harder path: the stand-in computes
# the logits as the block would, the FFN role swaps its router for them); the gate-on-FFN
# path is the block's own forward.
FAMILY_CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "mixtral": ("Mixtral", 2, ()),
    "qwen2_moe": ("Qwen2-MoE", 2, ()),
    "olmoe": ("OLMoE", 2, ()),
    "glm4_moe": ("GLM-4.5", 2, ()),
    "ernie45_moe": ("ERNIE-4.5-MoE", 2, ()),
    "minimax_m2": ("MiniMax-M2", 2, ()),
    "step3_text": ("Step-3", 2, ()),
    "gpt_oss": ("GPT-OSS", 2, ()),
    "llama4": ("Llama 4", 1, ()),
    "qwen3_next": ("Qwen3-Next", 2, ("--mamba-ssm-cache-dtype", "float32")),
}
FAMILIES = {f.name: f for f in architectures.FAMILIES}


def unless_marked_here(family: architectures.Family) -> pytest.MarkDecorator:
    """Skips a case of a family the installed vLLM line does not mark, saying why (also
    tests/unit/afd/test_afd_architectures.py)."""
    line = architectures.running_line()
    return pytest.mark.skipif(
        line not in family.lines,
        reason=f"{family.name} is marked on vLLM {', '.join(family.lines)} only, not on "
               f"{line}: {family.cpu_note}")  # fmt: skip


def family_param(name: str):
    return pytest.param(name, marks=unless_marked_here(FAMILIES[FAMILY_CASES[name][0]]))


# primary_pin: the ten families' cases take about 6.5 minutes on the CI machine; CI runs them
# on the primary pin, `make test-oracle VLLM_VERSION=X` on line X (docs/models.md).
@pytest.mark.primary_pin
@pytest.mark.parametrize("name", [family_param(n) for n in FAMILY_CASES])
def test_oracle_family(name, models_dir, tmp_path, procs):
    model = models_dir / name
    family_name, moe_layers, args = FAMILY_CASES[name]
    dtype = json.loads((model / "config.json").read_text())["torch_dtype"]
    engine_args = ("--dtype", dtype, *args)
    gated = FAMILIES[family_name].gate_on_attention
    # The plain reference (used by this case only) runs beside the AFD pair: engine
    # start-up is mostly one thread each.
    plain = start_plain(model, tmp_path, engine_args)
    procs.append(plain)
    ffn, [(attn, out)] = run_afd(procs, tmp_path, model, engine_args=engine_args,
                                 extra={"compute_gate_on_attention": gated})
    ref = plain.output(START_TIMEOUT)
    assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    worst = assert_matches(ref, json.loads(out.read_text()))
    assert EARLY_CONTROL in attn.text(), attn.tail()
    if gated:
        assert f"router of {moe_layers} MoE layer(s) runs on the attention role" \
            in attn.text(), attn.tail()
    print(f"{name} ({dtype}, router on the {'attention' if gated else 'FFN'} role): "
          f"tokens identical, max |logprob diff| {worst:.2e}")


# primary_pin: the start order is the overlay's retry logic, the same on every line.
@pytest.mark.primary_pin
def test_oracle_attention_started_first(models_dir, tmp_path, procs):
    model = models_dir / "qwen3_moe"
    plain = plain_reference(model, tmp_path)
    ffn, [(attn, out)] = run_afd(procs, tmp_path, model, attention_first=True)
    assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    assert_matches(plain, json.loads(out.read_text()))


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
def test_oracle_gate_on_attention(name, models_dir, tmp_path, procs):
    model = models_dir / name
    plain = plain_reference(model, tmp_path)
    ffn, [(attn, out)] = run_afd(procs, tmp_path, model,
                                 extra={"compute_gate_on_attention": True})
    assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    assert_matches(plain, json.loads(out.read_text()))
    # The router ran on the attention side (2 of the 3 layers are MoE).
    assert "router of 2 MoE layer(s) runs on the attention role" in attn.text(), attn.tail()


# primary_pin on pingpong: the schedule is overlay logic; the joined case runs on every line.
@pytest.mark.parametrize("schedule", ["join", pytest.param("pingpong",
                                                           marks=pytest.mark.primary_pin)])
def test_oracle_2a1f(schedule, models_dir, tmp_path, procs):
    """Two attention ranks feed one FFN rank, which batches ready ranks (join) or serves
    their steps interleaved layer by layer (connector_extra_config.ffn_schedule pingpong)."""
    model = models_dir / "qwen3_moe"
    plain = plain_reference(model, tmp_path)
    ffn, attns = run_afd(procs, tmp_path, model, num_attention=2, together=True,
                         extra={"connector_extra_config": {"ffn_schedule": schedule}})
    for attn, out in attns:
        assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
        assert_matches(plain, json.loads(out.read_text()))
    counts = ffn_stopped_counts(ffn)
    print(schedule, counts)  # steps served, how many joined or interleaved both ranks
    # Both ranks run the same prompts, started at once: with the 5 ms batch window, some
    # passes join them (41 of 65, 21 of 85, 27 of 79 steps here, 2 cores); none would mean no
    # batching. (Started as each engine came up, the ranks once did not overlap at all.)
    if schedule == "join":
        assert counts["batched"] > 0 and counts["pingpong"] == 0, counts
    else:  # the rounds of both ranks were interleaved, none joined
        assert counts["pingpong"] > 0 and counts["batched"] == 0, counts
        assert "interleaved layer by layer (connector_extra_config.ffn_schedule 'pingpong')" \
            in ffn.text(), ffn.tail()


def test_oracle_nixl_2a1f_one_rank_dbo(models_dir, tmp_path, procs):
    """Connector nixl (the control channel with the NIXL data plane: one-sided writes into
    registered inboxes over UCX): two attention ranks on one FFN rank, rank 0 with DBO
    (two micro-batches in flight), rank 1 without; each generates plain vLLM's tokens."""
    model = models_dir / "qwen3_moe"
    plain = plain_reference(model, tmp_path)
    ffn, attns = run_afd(procs, tmp_path, model, num_attention=2, together=True,
                         extra={"connector": "nixl"},
                         rank_args={0: ("--enable-dbo", "--dbo-threshold", "2")})
    for attn, out in attns:
        assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
        assert_matches(plain, json.loads(out.read_text()))
    assert "AFD attention role: DBO on, 2 micro-batches" in attns[0][0].text()
    assert "nixl agent afd-ffn0-" in ffn.text(), ffn.tail()
    counts = ffn_stopped_counts(ffn)
    print(counts)
    assert counts["ubatched"] > 0 and counts["steps"] > 0, counts


# primary_pin on 4A2F: the group's vLLM code is what 2A2F runs on every line.
@pytest.mark.parametrize("name, num_attention",
                         [("qwen3_moe", 2), pytest.param("deepseek_v2", 4, marks=pytest.mark.primary_pin)],
                         ids=["qwen3_moe-2A2F", "deepseek_v2-4A2F"])
def test_oracle_ffn_group(name, num_attention, models_dir, tmp_path, procs):
    """2A2F and 4A2F: one FFN server with tensor_parallel_size 2 runs FFN ranks 0
    and 1 as its two workers, each holding half of every expert (the CPU's MoE
    kernels do not take vLLM's expert map, so the group splits experts
    tensor-parallel; --enable-expert-parallel on CUDA). FFN rank f serves
    attention ranks f*k..f*k+k-1 (k = M/2), and every layer runs on the tokens of
    both members. Each attention rank's output equals plain vLLM's, which holds
    only if the members' shares are disjoint and are summed once (a member holding
    everything, or a missing all-reduce, would double or halve every FFN output),
    and each member sends every attention rank its own rows back."""
    model = models_dir / name
    plain = plain_reference(model, tmp_path)
    k = num_attention // 2
    ffn, attns = run_afd(procs, tmp_path, model, num_attention=num_attention, ffn_group=2)
    for attn, out in attns:
        assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
        assert_matches(plain, json.loads(out.read_text()))
    text = ffn.text()
    for f in (0, 1):
        peers = list(range(f * k, (f + 1) * k))
        assert f"AFD FFN rank {f} of an FFN group of 2 (experts split tensor-parallel): " \
               f"serving attention rank(s) {peers}" in text, ffn.tail()
    assert "AFD-FFN-GROUP ranks=[0, 1]" in text, ffn.tail()
    # SIGTERM to the server process only: it asks its workers for their counts.
    ffn.p.send_signal(signal.SIGTERM)
    ffn.p.wait(60)
    stopped = {int(m.group(1)): (int(m.group(2)), int(m.group(3)))
               for m in re.finditer(r"AFD-FFN-STOPPED rank=(\d) steps=(\d+) group_steps=(\d+)",
                                    ffn.text())}
    assert sorted(stopped) == [0, 1], ffn.tail()
    # Both members served steps of their own attention ranks, and every group step
    # ran on both (a member with no step of its own takes part with no rows).
    assert all(steps > 0 for steps, _ in stopped.values()), stopped
    assert stopped[0][1] == stopped[1][1] >= max(s for s, _ in stopped.values()), stopped
    print(f"{name} {num_attention}A2F group: tokens identical on every attention rank, "
          f"(steps, group steps) per member {stopped}")


# primary_pin: the refusal is overlay logic.
@pytest.mark.primary_pin
def test_ffn_group_refuses_micro_batched_steps(models_dir, tmp_path, procs):
    """An FFN group serves steps without micro-batches in this release: DBO
    attention ranks end with the group's error, and the FFN server ends too
    (every member stops, none is left waiting in the group's collectives)."""
    model = models_dir / "qwen3_moe"
    # The attention ranks start once the group listens: an attention rank whose FFN
    # rank ended before it connected retries for its timeout_s (20 s from its first
    # attempt), and none gives up while the group is still starting (a loaded host).
    ffn, attns = run_afd(procs, tmp_path, model, num_attention=2, ffn_group=2,
                         attn_extra={"timeout_s": 20}, ffn_ready_first=True,
                         attn_args=("--enable-dbo", "--dbo-threshold", "2"))
    t0 = time.monotonic()
    assert ffn.wait(START_TIMEOUT) == 3, ffn.tail()
    for attn, _ in attns:
        assert attn.wait(120) != 0, attn.tail()
    assert time.monotonic() - t0 < START_TIMEOUT
    text = ffn.text()
    assert "an FFN group (tensor_parallel_size > 1) serves steps without micro-batches" \
           in text and "drop --enable-dbo from the attention servers" in text, ffn.tail()
    assert "AFD-FFN-FAILED: a worker of the FFN group died" in text, ffn.tail()
    # The members end with os._exit, which skips vLLM's cleanup of its CPU
    # communicator's shared memory: the AFD exit path unlinks it (a file left
    # behind fails the next group server of the same internal port at start).
    deadline = time.monotonic() + 10
    while cpu_shm_files(ffn.vllm_port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cpu_shm_files(ffn.vllm_port) == [], ffn.tail()


@pytest.mark.parametrize("name, gate_on_attention",
                         [("qwen3_moe", False), ("deepseek_v2", False), ("qwen3_moe", True)])
def test_oracle_dbo(name, gate_on_attention, models_dir, tmp_path, procs):
    """--enable-dbo on the attention role: steps of at least 2 tokens run as two
    micro-batches that hand over at the remote-FFN op; the FFN rank serves them
    alternately (with the router logits of each micro-batch when the gate runs on the
    attention role). Same tokens and logprobs as plain vLLM."""
    model = models_dir / name
    plain = plain_reference(model, tmp_path)
    extra = {"compute_gate_on_attention": True} if gate_on_attention else None
    ffn, [(attn, out)] = run_afd(procs, tmp_path, model, extra=extra,
                                 attn_args=("--enable-dbo", "--dbo-threshold", "2"))
    assert attn.wait(START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    worst = assert_matches(plain, json.loads(out.read_text()))
    assert "AFD attention role: DBO on, 2 micro-batches" in attn.text(), attn.tail()
    if gate_on_attention:
        assert "router of 2 MoE layer(s) runs on the attention role" in attn.text(), attn.tail()
    counts = ffn_stopped_counts(ffn)
    # 4 sequences at a time: every step but the last decode steps of the last
    # prompt has >= 2 tokens, so most steps are micro-batched.
    assert counts["ubatched"] > counts["steps"] // 2, counts
    print(f"{name} DBO: tokens identical, max |logprob diff| {worst:.2e}, {counts}")


# The refusal tests start the FFN once the attention rank is trying to reach it: its
# hello then comes at once, and the FFN's start-up timeout (counted from its listen) can
# be short. The attention rank waits for the FFN with the default timeout.
REFUSING_FFN_TIMEOUT_S = 10


def test_mismatched_layer_count_ends_both(models_dir, tmp_path, procs):
    """The attention rank ends at the handshake; the FFN rank refuses it and ends at its
    start-up timeout, naming the refused hello."""
    ffn, [(attn, _)] = run_afd(procs, tmp_path, models_dir / "qwen3_moe",
                               attn_model=models_dir / "qwen3_moe_2l", attention_first=True,
                               extra={"timeout_s": REFUSING_FFN_TIMEOUT_S},
                               attn_extra={"timeout_s": 120})
    assert attn.wait(START_TIMEOUT) != 0
    assert ffn.wait(START_TIMEOUT) != 0
    for p in (attn, ffn):
        assert "mismatch on 'num_hidden_layers'" in p.text(), p.tail()
    assert f"did not connect within timeout_s={REFUSING_FFN_TIMEOUT_S}. Last refused hello" \
        in ffn.text(), ffn.tail()


# primary_pin: the same refusal path as the mismatched layer count, which runs on every line.
@pytest.mark.primary_pin
def test_wrong_topology_ends_both(models_dir, tmp_path, procs):
    model = models_dir / "qwen3_moe"
    port = free_port(2)
    attn = AfdProc("attention", model, tmp_path / "attn.log",
                   ["--afd", afd_json("attention", port), "--prompts",
                    str(write_prompts(tmp_path)), "--out", str(tmp_path / "o.json")])
    procs.append(attn)
    assert attn.wait_for_log("AFD: connecting to FFN rank", START_TIMEOUT) is not None, \
        attn.tail()
    ffn = AfdProc("ffn", model, tmp_path / "ffn.log",
                  ["--afd", afd_json("ffn", port, num_attention_ranks=2,
                                     timeout_s=REFUSING_FFN_TIMEOUT_S)])
    procs.append(ffn)
    assert attn.wait(START_TIMEOUT) != 0
    assert ffn.wait(START_TIMEOUT) != 0
    for p in (attn, ffn):
        assert "mismatch on 'num_attention_ranks'" in p.text(), p.tail()


EXIT_S = 30.0  # an engine's teardown after its fatal error


def test_ffn_killed_mid_generation(models_dir, tmp_path, procs):
    """Attention fails with an error naming the FFN peer within timeout_s + 5 s."""
    model = models_dir / "qwen3_moe"
    timeout_s = 5
    port = free_port()
    # 64 requests of 480 tokens, 4 at a time: thousands of steps, so the
    # generation cannot finish before the kill on however fast a machine.
    spec = {"prompts": ["Hello, my name is"] * 64, "max_tokens": [480] * 64}
    ffn = AfdProc("ffn", model, tmp_path / "ffn.log",
                  ["--afd", afd_json("ffn", port, timeout_s=timeout_s)])
    procs.append(ffn)
    attn = AfdProc("attention", model, tmp_path / "attn.log",
                   ["--afd", afd_json("attention", port, timeout_s=timeout_s),
                    "--max-num-seqs", "4",
                    "--prompts", str(write_prompts(tmp_path, spec)),
                    "--out", str(tmp_path / "o.json")])
    procs.append(attn)
    assert attn.wait_for_log("AFD-PROC-GENERATING", START_TIMEOUT, poll=0.5) is not None, \
        attn.tail()
    time.sleep(1)  # generation under way
    assert attn.p.poll() is None, attn.tail()
    ffn.kill()
    killed_at = time.monotonic()
    # the error is logged within the bound (polled at 0.1 s); the engine's teardown after
    # it (the process exit) gets EXIT_S more
    seen = attn.wait_for_log("lost AFD peer FFN rank 0", timeout_s + 60, poll=0.1)
    noticed = time.monotonic() - killed_at
    rc = attn.wait(EXIT_S)
    exited = time.monotonic() - killed_at
    assert seen is not None, attn.tail()
    assert rc != 0, attn.tail()
    assert not (tmp_path / "o.json").exists()
    assert noticed <= timeout_s + 5, f"attention took {noticed:.1f} s to fail"
    print(f"attention failed {noticed:.1f} s after the FFN was killed, exited at {exited:.1f} s")


# primary_pin (this and the next): a start-up timeout with no peer at all differs from the
# mismatched layer count case only in the overlay's connector (unit-tested in
# test_tcp_connector); that case runs the same failure paths on every line's engine.
@pytest.mark.primary_pin
def test_no_ffn_within_timeout(models_dir, tmp_path, procs):
    attn = AfdProc("attention", models_dir / "llama", tmp_path / "attn.log",
                   ["--afd", afd_json("attention", free_port(), timeout_s=3),
                    "--prompts", str(write_prompts(tmp_path)), "--out", str(tmp_path / "o.json")])
    procs.append(attn)
    assert attn.wait(START_TIMEOUT) != 0
    assert "could not reach AFD FFN rank 0 at 127.0.0.1" in attn.text(), attn.tail()


@pytest.mark.primary_pin
def test_no_attention_within_timeout(models_dir, tmp_path, procs):
    ffn = AfdProc("ffn", models_dir / "llama", tmp_path / "ffn.log",
                  ["--afd", afd_json("ffn", free_port(), timeout_s=3)])
    procs.append(ffn)
    assert ffn.wait(START_TIMEOUT) == 3
    assert "did not connect within timeout_s=3" in ffn.text(), ffn.tail()


# DeepSeek-V2 as its released configs have it: q LoRA, group-limited routing, two dense first
# layers, a routed scaling factor; oracle_lib.mixed_length_prompts (12 prompts of 1 to 311
# tokens at once, 32 greedy tokens each).
QLORA_ENGINE = ("--max-num-seqs", "12")
QLORA_DBO = ("--enable-dbo", "--dbo-threshold", "2", "--dbo-prefill-threshold", "12")


# primary_pin: about 70 s; the DBO cases of the other checkpoints run on every line.
@pytest.mark.primary_pin
def test_oracle_dbo_grouped_routing_q_lora(models_dir, tmp_path, procs):
    """One FFN server serves an attention rank with DBO (decode threshold 2, prefill 12),
    then one without; both equal plain vLLM on the deepseek_v2_qlora checkpoint (fp32)."""
    model = models_dir / "deepseek_v2_qlora"
    spec = mixed_length_prompts()
    for sub in ("plain", "dbo", "serial"):
        (tmp_path / sub).mkdir()
    plain = harness.start_plain(model, tmp_path / "plain", spec, max_num_seqs=12)
    procs.append(plain)
    port = free_port()
    ffn = AfdProc("ffn", model, tmp_path / "ffn.log", ["--afd", afd_json("ffn", port)])
    procs.append(ffn)

    def attention(tag: str, args: tuple[str, ...]) -> dict:
        p = AfdProc("attention", model, tmp_path / f"attn_{tag}.log",
                    ["--afd", afd_json("attention", port),
                     "--prompts", str(write_prompts(tmp_path / tag, spec)),
                     "--out", str(tmp_path / f"{tag}.json"), *QLORA_ENGINE, *args])
        procs.append(p)
        assert p.wait(START_TIMEOUT) == 0, p.tail() + "\n--- ffn ---\n" + ffn.tail()
        return json.loads((tmp_path / f"{tag}.json").read_text())

    dbo = attention("dbo", QLORA_DBO)
    ref = plain.output(START_TIMEOUT)
    dbo_text = (tmp_path / "attn_dbo.log").read_text()
    assert "DBO on, 2 micro-batches per step from 2 decode / 12 prefill tokens" in dbo_text
    worst_dbo = assert_outputs_match(ref, dbo, spec["max_tokens"], LOGPROB_TOL)
    worst = assert_outputs_match(ref, attention("serial", ()), spec["max_tokens"], LOGPROB_TOL)
    counts = ffn_stopped_counts(ffn)
    # Half of the steps served are the DBO rank's, and nearly all of those are split.
    assert counts["ubatched"] > counts["steps"] // 4, counts
    print(f"deepseek_v2_qlora: tokens identical with DBO (max |logprob diff| {worst_dbo:.2e}) "
          f"and without ({worst:.2e}), {counts}")
