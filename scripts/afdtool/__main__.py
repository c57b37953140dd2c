"""`python3 -m afdtool <command>`: the entry point the Makefile calls."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import targets
from .errors import AfdError

# command -> (module, one-line help). Modules are imported only when their command runs
# (or when `--help` of that command is asked), so a missing optional module breaks nothing else.
COMMANDS = {
    "fetch": ("fetch", "download (or reuse from the cache) the pinned sdist / wheels"),
    "apply": ("apply", "pinned source + overlay/ + patches/series -> build tree (git repo)"),
    "export": ("export", "commits after the overlay commit -> patches/ and overlay/"),
    "check": ("check", "series applies strictly, re-export is byte-identical, headers, compile"),
    "wheel": ("wheel", "build the custom wheel (--variant cuda|cpu)"),
    "venv": ("venv", "create/update a venv with torch and the custom CPU wheel"),
    "bundle": ("bundle", "offline install bundle for the GPU host"),
    "revision": ("revision", "print the target's patch-set revision (the wheel's +afd.<rev>)"),
    "target": ("targets", "print the resolved target (pin, patches, tree, venv, models, rev)"),
    "rebase": ("rebase", "carry the series to upstream release X (--to X) -> targets/X/"),
    "rebase-continue": ("rebase", "resume a stopped rebase after resolving (or --skip)"),
    "rebase-abort": ("rebase", "abort a rebase: restore the tree exactly as it was"),
    "rebase-report": ("report", "try the series on every newer release -> markdown table"),
    "drift": ("drift", "static check of overlay imports/calls against release X (--to X)"),
}
# Commands whose --target names the series to start from: default the newest carried target
# (older than --to), not the primary pin; their --tree is the rebase's tree, not the target's.
FROM_NEWEST = {"rebase", "rebase-report", "drift"}
TREE_COMMANDS = {"apply", "export", "wheel", "target", "rebase", "rebase-continue",
                 "rebase-abort"}
REBASE_TREE = {"rebase", "rebase-continue", "rebase-abort"}


def resolve_target(command: str, args) -> None:
    """Build the one Target of this run (args.target) from --target / --repo-root / --tree."""
    name = args.target_name
    args.target_default = not name
    if not name and command in FROM_NEWEST:
        name = targets.newest_carried(args.repo_root, below=getattr(args, "to", None))
    tree = None if command in REBASE_TREE else getattr(args, "tree", None)
    args.target = targets.resolve(args.repo_root, name, tree)


def _load(command: str):
    modname = COMMANDS[command][0]
    try:
        return importlib.import_module(f"afdtool.{modname}")
    except ModuleNotFoundError as exc:
        if exc.name == f"afdtool.{modname}":
            raise AfdError(
                f"command {command!r} is not available: module afdtool/{modname}.py is missing"
            ) from None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="afdtool", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Only the chosen command's module is imported to build its arguments.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    try:
        for name, (_mod, help_text) in COMMANDS.items():
            p = sub.add_parser(name, help=help_text, description=help_text)
            if name == chosen:
                module = _load(name)
                # a module serving several commands maps them in COMMANDS to (add_arguments, run)
                add, run = getattr(module, "COMMANDS", {}).get(name, (None, None))
                targets.add_arguments(p, tree=name in TREE_COMMANDS,
                                      from_newest=name in FROM_NEWEST)
                (add or module.add_arguments)(p)
                p.set_defaults(_run=run or module.run)
        args = parser.parse_args(argv)
        resolve_target(args.command, args)
        return int(args._run(args) or 0)
    except AfdError as exc:
        print(f"afdtool: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("afdtool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
