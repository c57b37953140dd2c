"""AFD overhead on the CPU: per-layer connector round trip and engine step time.

    .venv/bin/python benchmarks/cpu_overhead.py [--model build/models/qwen3_moe]

1. Per-layer exchange: the TCP (`gloo`) connector over loopback, attention side
   sends a layer's hidden states and waits for the FFN side's echo
   (no FFN compute), for several token counts and hidden sizes.
2. Engine level: the same greedy decode run (8 prompts x 64 tokens) on plain
   vLLM and on an AFD 1A1F pair of the tiny checkpoint, one after the other,
   reporting wall time per decode step. Measured on a shared 2-core machine,
   so compare figures from one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Ports below the ephemeral range (scripts/serve_util/ports.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from serve_util import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROC = REPO / "tests" / "cpu" / "afd_proc.py"


def connector_round_trip(hidden: int, tokens: list[int], iters: int) -> list[tuple]:
    import torch

    from vllm.afd.protocol import FINGERPRINT_KEYS
    from vllm.config.afd import AFDConfig
    from vllm.distributed.afd.base import ConnectorContext
    from vllm.distributed.afd.tcp import TCPAttentionConnector, TCPFFNConnector

    cfg = AFDConfig.from_dict({"role": "ffn", "port": free_port(), "timeout_s": 10})
    fp = {**{k: 1 for k in FINGERPRINT_KEYS}, "afd_revision": "bench"}

    def ctx(role: str) -> ConnectorContext:
        c = AFDConfig.from_dict({**cfg.to_dict(), "role": role})
        return ConnectorContext(c, 0, fp, 4096, torch.device("cpu"))

    ffn = TCPFFNConnector(ctx("ffn"))
    ffn.start()
    attn = TCPAttentionConnector(ctx("attention"))
    attn.connect()
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            for peer in ffn.wait_step(0.1):
                buf = torch.empty((peer.control.num_tokens, hidden))
                for _ in range(iters):
                    ffn.recv(peer, buf)
                    ffn.send(peer, buf)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden)
        out = torch.empty_like(x)
        attn.begin_step(n, n)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            attn.send(x)
            attn.recv(out)
            samples.append(time.perf_counter() - t0)
        attn.end_step()
        assert torch.equal(out, x)
        rows.append((hidden, n, statistics.median(samples) * 1e6, min(samples) * 1e6))
    stop.set()
    attn.close()
    t.join(2)
    ffn.close()
    return rows


def engine_step_time(model: Path, n_prompts: int, max_tokens: int) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if "deepseek" in model.name:
        env["VLLM_MLA_DISABLE"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="afd-bench-"))
    spec = {"prompts": [f"Prompt number {i} says" for i in range(n_prompts)],
            "max_tokens": [max_tokens] * n_prompts}
    (tmp / "p.json").write_text(json.dumps(spec))
    common = ["--model", str(model), "--prompts", str(tmp / "p.json"), "--logprobs", "0",
              "--max-num-seqs", str(n_prompts)]

    def run(args, out):
        r = subprocess.run([sys.executable, str(PROC), *args, *common, "--out", str(out)],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stdout[-3000:] + r.stderr[-3000:])
        return json.loads(out.read_text())

    plain = run(["plain"], tmp / "plain.json")
    port = free_port()
    cfg = {"port": port, "timeout_s": 120}
    ffn = subprocess.Popen(
        [sys.executable, str(PROC), "ffn", "--model", str(model),
         "--afd", json.dumps({"role": "ffn", **cfg})],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        afd = run(["attention", "--afd", json.dumps({"role": "attention", **cfg})],
                  tmp / "afd.json")
    finally:
        ffn.terminate()
        ffn.wait(30)
    same = [a["token_ids"] for a in plain["outputs"]] == [b["token_ids"] for b in afd["outputs"]]
    return {"plain_s": plain["generate_s"], "afd_s": afd["generate_s"], "steps": max_tokens,
            "tokens_equal": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "build" / "models" / "qwen3_moe"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("\n1) TCP connector, one layer exchange (send + receive), loopback")
    print(f"{'hidden':>7} {'tokens':>7} {'median us':>10} {'min us':>8}")
    for hidden in (128, 2048):
        for row in connector_round_trip(hidden, [1, 16, 64, 256], args.iters):
            print(f"{row[0]:>7} {row[1]:>7} {row[2]:>10.1f} {row[3]:>8.1f}")
    if not args.skip_engine:
        r = engine_step_time(Path(args.model), 8, 64)
        print(f"\n2) engine, {Path(args.model).name}, 8 prompts x 64 tokens, eager, fp32")
        for side in ("plain", "afd"):
            t = r[f"{side}_s"]
            print(f"  {side:>5}: {t:.2f} s generate, {t / r['steps'] * 1e3:.1f} ms per decode step")
        extra = (r["afd_s"] - r["plain_s"]) / r["steps"] * 1e3
        print(f"  AFD - plain: {extra:+.1f} ms per step; tokens equal: {r['tokens_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
