"""Reading the logs of the processes started: tails, the root-cause traceback, a line
that appears."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path


def log_tail(log_path: str | os.PathLike, lines: int = 60) -> str:
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {log_path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def _traceback_blocks(lines: list[str]) -> list[list[str]]:
    """Each Python traceback of a log's lines, up to its error line."""
    def block(i: int) -> list[str]:
        out = [lines[i]]
        for ln in lines[i + 1:]:
            out.append(ln)
            body = ln.split("] ", 1)[-1] if "ERROR" in ln else ln.split(") ", 1)[-1]
            if body and not body.startswith((" ", "\t", "Traceback")) and (
                "Error" in body or "Exception" in body or "Interrupt" in body
            ):
                break
        return out

    return [block(i) for i, ln in enumerate(lines)
            if "Traceback (most recent call last)" in ln]


def _format_tracebacks(blocks: list[list[str]], max_lines: int) -> str:
    first = blocks[0]
    out = first[:max_lines] + (["    ..."] + first[-3:] if len(first) > max_lines else [])
    finals = []
    for b in blocks[1:]:
        if b[-1] not in finals and b[-1] != first[-1]:
            finals.append(b[-1])
    if finals:
        out += ["(later tracebacks end with:)"] + finals
    return "\n".join(out)


def _log_lines(log_path: str | os.PathLike) -> list[str] | None:
    try:
        return Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None


def find_traceback(log_path: str | os.PathLike, max_lines: int = 60) -> str | None:
    """The first Python traceback of a log (usually the root cause; vLLM's wrappers re-raise
    it later as "Engine core initialization failed") plus the final exception line of every
    later one; None when the log has no traceback."""
    blocks = _traceback_blocks(_log_lines(log_path) or [])
    return _format_tracebacks(blocks, max_lines) if blocks else None


def failure_excerpt(log_path: str | os.PathLike, lines: int = 40) -> str:
    """For a test's failure report: the log's first traceback (the root cause: a
    worker's error sits far above the executor's re-raise), its last ``lines`` lines,
    and last the root cause's own line (what a truncated report still shows)."""
    all_lines = _log_lines(log_path)
    if all_lines is None:
        return log_tail(log_path, lines)  # says why it cannot be read
    last = "\n".join(all_lines[-lines:])
    blocks = _traceback_blocks(all_lines)
    if not blocks:
        return last
    return (f"{_format_tracebacks(blocks, 60)}\n--- last {lines} lines ---\n{last}\n"
            f"--- root cause: {blocks[0][-1].strip()}")


def wait_for_log(
    log_path: str | os.PathLike,
    text: str,
    timeout: float,
    proc: subprocess.Popen | None = None,
    poll: float = 0.2,
) -> float | None:
    """Seconds until ``text`` appears in the log, or None after ``timeout`` or (when
    ``proc`` is given) once ``proc`` has exited without writing it."""
    t0 = time.monotonic()
    while True:
        try:
            if text in Path(log_path).read_text(errors="replace"):
                return time.monotonic() - t0
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            # one last look: the line may have been written just before the exit
            with contextlib.suppress(OSError):
                if text in Path(log_path).read_text(errors="replace"):
                    return time.monotonic() - t0
            return None
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(poll)
