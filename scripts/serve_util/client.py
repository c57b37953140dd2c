"""HTTP client of a `vllm serve` server (stdlib only): GET, JSON POST, completions
(streamed or not), and reading a completion's choice."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; raises OSError (URLError, ConnectionError) when the
    connection fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post_json(url: str, payload: dict[str, Any], timeout: float = 300.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text) of a JSON POST; HTTP errors are returned, not
    raised; a failed connection or a timeout raises OSError."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def completion(base_url: str, prompt: str, *, timeout: float = 300.0,
               **params: Any) -> tuple[int, Any]:
    """POST /v1/completions (the model name is optional with one served model)."""
    return post_json(f"{base_url}/v1/completions", {"prompt": prompt, **params}, timeout)


def stream_completion(base_url: str, prompt: str, *, timeout: float = 300.0,
                      on_chunk: Any = None, **params: Any) -> dict[str, Any]:
    """POST /v1/completions with ``stream: true`` and read it to the end. Never raises for
    a server-side failure; returns ``{"status", "chunks", "text", "finish_reason", "error",
    "done"}``: ``error`` is an error chunk's message, an HTTP error or the exception that
    ended the stream (a reset connection, a timeout); ``done`` says "[DONE]" arrived.
    ``on_chunk(chunk)`` is called for every data chunk (e.g. to learn that tokens flow)."""
    out: dict[str, Any] = {"status": None, "chunks": 0, "text": "", "finish_reason": None,
                           "error": None, "done": False}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps({"prompt": prompt, **params, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out["status"] = r.status
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if "error" in chunk:
                    out["error"] = error_message(chunk)
                    continue
                out["chunks"] += 1
                for choice in chunk.get("choices") or []:
                    out["text"] += choice.get("text") or ""
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                if on_chunk is not None:
                    on_chunk(chunk)
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        out["error"] = error_message(_json_or_text(e.read()))
    except Exception as e:  # noqa: BLE001 - any way the stream can end is a result here
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _json_or_text(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def error_message(body: Any) -> str:
    """The message of an OpenAI-style error body (or the body as text)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


def parse_choice(body: dict[str, Any]) -> dict[str, Any]:
    """text, tokens (strings; "token_id:N" with return_tokens_as_token_ids) and per-position
    top logprobs ({token: logprob}) of the first choice of a completion response."""
    choice = body["choices"][0]
    lp = choice.get("logprobs") or {}
    return {
        "text": choice.get("text", ""),
        "tokens": list(lp.get("tokens") or []),
        "token_logprobs": list(lp.get("token_logprobs") or []),
        "top_logprobs": [dict(d or {}) for d in (lp.get("top_logprobs") or [])],
        "finish_reason": choice.get("finish_reason"),
    }


def token_ids(tokens: list[str]) -> list[int]:
    """Token ids of "token_id:N" strings (return_tokens_as_token_ids=true)."""
    return [int(t.split(":", 1)[1]) for t in tokens]
