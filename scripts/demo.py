"""CPU demo: an AFD deployment (1 attention + 1 FFN `vllm serve`) against plain vLLM.

    python scripts/demo.py --model build/models/qwen3_moe [--python PY] [--keep-logs DIR]

Starts the FFN server, then the attention server (gloo connector, 1A1F), sends four fixed
prompts concurrently (greedy, 16 tokens, top-5 logprobs) to the attention server, checks that
the FFN server refuses generation, stops both; then serves the same model without AFD, sends
the same prompts and prints both side by side. Exit code 0 only on MATCH: identical tokens and
top-5 logprobs within 1e-4 at every position. Every server is stopped on every exit path.
The servers run eager with TorchDynamo off (TORCHDYNAMO_DISABLE=1 unless set in the
environment): it would compile only a sampler helper, at 12-16 s per engine start on the CPU.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_util as su  # noqa: E402

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "One, two, three,",
    "def add(a, b):",
]
PARAMS = {
    "temperature": 0.0,
    "max_tokens": 16,
    "logprobs": 5,
    "ignore_eos": True,
    "return_tokens_as_token_ids": True,
}
LOGPROB_TOL = 1e-4
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


def send_all(server: su.Server) -> tuple[list[dict], float]:
    """The prompts concurrently (one thread each); parsed choices and the wall time."""

    def one(prompt: str) -> dict:
        status, body = server.completion(prompt, timeout=REQUEST_TIMEOUT_S, **PARAMS)
        if status != 200:
            raise RuntimeError(f"{server.name}: HTTP {status} for {prompt!r}: "
                               f"{su.error_message(body)}")
        return su.parse_choice(body)

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    return results, time.monotonic() - t0


def check_ffn_refuses(ffn: su.Server) -> str:
    status, body = ffn.completion(PROMPTS[0], timeout=60, **PARAMS)
    msg = su.error_message(body)
    if not (400 <= status < 500 and "AFD" in msg):
        raise RuntimeError(f"FFN server did not refuse generation: HTTP {status}: {msg}")
    return f"HTTP {status}: {msg}"


def run_afd(args, log_dir: Path) -> dict:
    api_attn, api_ffn, afd_port = su.free_ports(3)
    cfg = dict(port=afd_port, timeout_s=120)
    ffn = attn = None
    try:
        print(f"[afd] starting FFN server on :{api_ffn} (AFD port {afd_port})", flush=True)
        ffn = su.Server.start("ffn", args.model, api_ffn, log_dir / "afd_ffn.log",
                              afd_config=su.afd_config("ffn", **cfg), python=args.python,
                              env=args.env, extra_args=args.extra)
        print(f"[afd] starting attention server on :{api_attn}", flush=True)
        attn = su.Server.start("attention", args.model, api_attn, log_dir / "afd_attention.log",
                               afd_config=su.afd_config("attention", **cfg),
                               python=args.python, env=args.env, extra_args=args.extra)
        ready = su.wait_all_healthy([ffn, attn], timeout=START_TIMEOUT_S)
        print(f"[afd] both healthy (ffn {ready['ffn']:.1f} s, attention "
              f"{ready['attention']:.1f} s after start)", flush=True)
        results, req_s = send_all(attn)
        print(f"[afd] {len(results)} completions in {req_s:.2f} s", flush=True)
        refusal = check_ffn_refuses(ffn)
        print(f"[afd] FFN server refuses generation: {refusal[:120]}", flush=True)
        return {"results": results, "start_s": max(ready.values()), "request_s": req_s,
                "refusal": refusal}
    except Exception:
        for srv in (attn, ffn):
            if srv is not None:
                report_traceback(srv)
        raise
    finally:
        su.stop_servers([attn, ffn])


def run_plain(args, log_dir: Path) -> dict:
    (port,) = su.free_ports(1)
    srv = None
    try:
        print(f"[plain] starting plain vLLM server on :{port}", flush=True)
        srv = su.Server.start("plain", args.model, port, log_dir / "plain.log",
                              python=args.python, env=args.env, extra_args=args.extra)
        start_s = srv.wait_healthy(timeout=START_TIMEOUT_S)
        print(f"[plain] healthy after {start_s:.1f} s", flush=True)
        results, req_s = send_all(srv)
        print(f"[plain] {len(results)} completions in {req_s:.2f} s", flush=True)
        return {"results": results, "start_s": start_s, "request_s": req_s}
    except Exception:
        if srv is not None:
            report_traceback(srv)
        raise
    finally:
        if srv is not None:
            srv.stop()


def report_traceback(srv: su.Server) -> None:
    tb = su.find_traceback(srv.log_path)
    if tb:
        print(f"--- last traceback in {srv.log_path} ---\n{tb}\n---", file=sys.stderr)


def short(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "~"


def compare(afd: dict, plain: dict) -> bool:
    rows, ok = [], True
    for prompt, a, p in zip(PROMPTS, afd["results"], plain["results"]):
        for side in (a, p):  # the comparison needs every position's top-5 logprobs
            if not side["tokens"] or len(side["top_logprobs"]) != len(side["tokens"]):
                raise RuntimeError(f"{prompt!r}: incomplete logprobs in a response: {side}")
        same = a["tokens"] == p["tokens"] and a["text"] == p["text"]
        diff = su.max_logprob_diff(a["top_logprobs"], p["top_logprobs"])
        ok = ok and same and diff <= LOGPROB_TOL
        rows.append((short(prompt, 26), short(a["text"], 34), short(p["text"], 34),
                     "yes" if same else "NO", f"{diff:.2e}"))
    head = ("prompt", "AFD text", "plain text", "tokens equal", "max |dlogprob|")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("{:<" + str(w) + "}" for w in widths)
    print()
    print(line.format(*head))
    print(line.format(*("-" * w for w in widths)))
    for r in rows:
        print(line.format(*r))
    print()
    if not ok:
        for prompt, a, p in zip(PROMPTS, afd["results"], plain["results"]):
            if a["tokens"] != p["tokens"]:
                print(textwrap.shorten(f"{prompt!r}: AFD {su.token_ids(a['tokens'])} "
                                       f"plain {su.token_ids(p['tokens'])}", 400))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with the AFD vLLM build (default: this one)")
    ap.add_argument("--keep-logs", metavar="DIR",
                    help="write the server logs here (default: a new temp dir)")
    ap.add_argument("--env", dest="env_list", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for every server (repeatable)")
    ap.add_argument("--serve-args", default="", metavar="ARGS",
                    help="extra `vllm serve` arguments for every server (one string)")
    args = ap.parse_args()
    args.extra = shlex.split(args.serve_args)
    args.model = str(Path(args.model).resolve())
    if not Path(args.model, "config.json").is_file():
        print(f"{args.model}: no config.json (run `make models`)", file=sys.stderr)
        return 2
    args.env = {"VLLM_MLA_DISABLE": "1"} if "deepseek" in Path(args.model).name else {}
    if "TORCHDYNAMO_DISABLE" not in os.environ:
        # The servers are eager (--enforce-eager); TorchDynamo would only compile a helper
        # of the sampler, and on the CPU that makes each engine start probe the vector ISA
        # in new Python processes (12-16 s). TORCHDYNAMO_DISABLE=0 keeps it on.
        args.env["TORCHDYNAMO_DISABLE"] = "1"
    for item in args.env_list:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--env {item!r}: expected KEY=VALUE")
        args.env[key] = value

    su.install_cleanup()
    if args.keep_logs:
        log_dir = Path(args.keep_logs).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="afd-demo-"))
    print(f"model {args.model}\nlogs  {log_dir}", flush=True)

    try:
        afd = run_afd(args, log_dir)
        plain = run_plain(args, log_dir)
        ok = compare(afd, plain)
    except (su.ServerDied, RuntimeError, OSError) as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        print(f"logs in {log_dir}\nMISMATCH (demo failed)")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the servers", file=sys.stderr)
        return 130
    except SystemExit as e:  # SIGTERM/SIGHUP (su.install_cleanup)
        print(f"\nterminated (exit {e.code}); stopping the servers", file=sys.stderr)
        raise
    finally:
        su.stop_all()

    print(f"timings: AFD pair start {afd['start_s']:.1f} s, requests {afd['request_s']:.2f} s; "
          f"plain start {plain['start_s']:.1f} s, requests {plain['request_s']:.2f} s")
    print(f"logs in {log_dir}")
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
