"""AFD overhead on the CPU: per-layer connector round trip and engine step time.

    .venv/bin/python benchmarks/cpu_overhead.py [--model build/models/qwen3_moe]
        [--connectors gloo,nixl]

1. Per-layer exchange of each connector over loopback (`gloo`: the channel's socket;
   `nixl`: NIXL writes into registered inboxes, UCX), attention side sends a layer's
   hidden states and waits for the FFN side's echo (no FFN compute), for several token
   counts and hidden sizes.
2. Engine level: the same greedy decode run (8 prompts x 64 tokens) on plain
   vLLM and on an AFD 1A1F pair of the tiny checkpoint per connector, one after the
   other, reporting wall time per decode step. Measured on a shared 2-core machine,
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
import time
from pathlib import Path

# Ports below the ephemeral range (scripts/serve_util/ports.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from serve_util import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROC = REPO / "tests" / "cpu" / "afd_proc.py"


def _context(connector: str, role: str, port: int, hidden: int, max_tokens: int):
    import torch

    from vllm.afd.protocol import FINGERPRINT_KEYS, PROTOCOL_VERSION
    from vllm.config.afd import AFDConfig
    from vllm.distributed.afd.base import ConnectorContext

    cfg = AFDConfig.from_dict({"role": role, "port": port, "timeout_s": 60,
                               "connector": connector})  # fmt: skip
    fp = {**{k: 1 for k in FINGERPRINT_KEYS}, "afd_revision": "bench", "hidden_size": hidden,
          "dtype": "float32", "protocol": PROTOCOL_VERSION}  # fmt: skip
    return ConnectorContext(cfg, 0, fp, max_tokens, torch.device("cpu"))


def _echo(connector: str, port: int, hidden: int, max_tokens: int, iters: int) -> None:
    """The FFN side, in a process of its own (as it is deployed): echo every layer."""
    import torch

    from vllm.distributed.afd.base import create_ffn_connector

    ffn = create_ffn_connector(_context(connector, "ffn", port, hidden, max_tokens))
    ffn.start()
    served = 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for peer in ffn.wait_step(0.1):
            buf = torch.empty((peer.control.num_tokens, hidden))
            for _ in range(iters):
                ffn.recv(peer, buf)
                ffn.send(peer, buf)
            served += 1
        if served and not ffn.peers:  # the attention side said goodbye
            break
    ffn.close()


def connector_round_trip(
    connector: str, hidden: int, tokens: list[int], iters: int
) -> list[tuple]:
    import multiprocessing

    import torch

    from vllm.distributed.afd.base import create_attention_connector

    port = free_port()
    echo = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(connector, port, hidden, max(tokens), iters), daemon=True)
    echo.start()
    attn = create_attention_connector(
        _context(connector, "attention", port, hidden, max(tokens)))
    attn.connect()
    rows = []
    for step, n in enumerate(tokens, start=1):
        x = torch.randn(n, hidden)
        out = torch.empty_like(x)
        attn.begin_step(step, n)
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            attn.send(x)
            attn.recv(out)
            samples.append(time.perf_counter() - t0)
        attn.end_step()
        assert torch.equal(out, x)
        rows.append((hidden, n, statistics.median(samples) * 1e6, min(samples) * 1e6))
    attn.close()
    echo.join(30)
    return rows


def engine_step_time(model: Path, n_prompts: int, max_tokens: int,
                     connectors: list[str]) -> dict:
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
    result = {"plain_s": plain["generate_s"], "steps": max_tokens}
    for connector in connectors:
        cfg = {"port": free_port(), "timeout_s": 120, "connector": connector}
        ffn = subprocess.Popen(
            [sys.executable, str(PROC), "ffn", "--model", str(model),
             "--afd", json.dumps({"role": "ffn", **cfg})],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            afd = run(["attention", "--afd", json.dumps({"role": "attention", **cfg})],
                      tmp / f"afd_{connector}.json")
        finally:
            ffn.terminate()
            ffn.wait(30)
        result[f"{connector}_s"] = afd["generate_s"]
        result[f"{connector}_tokens_equal"] = [a["token_ids"] for a in plain["outputs"]] == [
            b["token_ids"] for b in afd["outputs"]]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "build" / "models" / "qwen3_moe"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--connectors", default="gloo,nixl",
                   help="comma-separated connectors to measure (default gloo,nixl)")
    args = p.parse_args()
    connectors = [c for c in args.connectors.split(",") if c]
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("\n1) one layer exchange (send + receive), loopback, fp32")
    print(f"{'connector':>9} {'hidden':>7} {'tokens':>7} {'median us':>10} {'min us':>8}")
    for connector in connectors:
        for hidden in (128, 2048):
            for row in connector_round_trip(connector, hidden, [1, 16, 64, 256], args.iters):
                print(f"{connector:>9} {row[0]:>7} {row[1]:>7} {row[2]:>10.1f} {row[3]:>8.1f}")
    if not args.skip_engine:
        r = engine_step_time(Path(args.model), 8, 64, connectors)
        print(f"\n2) engine, {Path(args.model).name}, 8 prompts x 64 tokens, eager, fp32")
        for side in ("plain", *connectors):
            t = r[f"{side}_s"]
            same = "" if side == "plain" else (
                f"  (tokens equal plain's: {r[f'{side}_tokens_equal']})")
            print(f"  {side:>5}: {t:.2f} s generate, {t / r['steps'] * 1e3:.1f} ms per decode "
                  f"step, {t / r['plain_s']:.2f}x plain{same}")
        extra = (r["afd_s"] - r["plain_s"]) / r["steps"] * 1e3
        print(f"  AFD - plain: {extra:+.1f} ms per step; tokens equal: {r['tokens_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
