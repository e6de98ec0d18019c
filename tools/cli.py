"""The `deltaserve` console entry: `deltaserve serve|generate|monitor ...`.

Each subcommand owns its argument parser (`deltaserve serve --help`); this file only
dispatches, importing the subcommand lazily so that `deltaserve --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import deltaserve

SUBCOMMANDS = {
    "serve": (
        "deltaserve.tools.cli",
        "serve_main",
        "serve a model over an OpenAI-compatible HTTP API",
    ),
    "generate": ("deltaserve.engine.generate", "main", "generate from prompts in-process"),
    "monitor": ("deltaserve.tools.monitor", "main", "watch a running engine's monitor endpoint"),
}

USAGE = "usage: deltaserve {serve,generate,monitor} [options]  (deltaserve COMMAND --help)"


def serve_main(argv: list[str]) -> int:
    """`deltaserve serve`: http/serve.py's, handed the demo checkpoint (tools/demo_model.py)
    to serve when no MODEL is given: the serving layers import nothing of tools/."""
    from deltaserve.http.serve import serve_main as serve
    from deltaserve.tools.demo_model import demo_checkpoint

    return serve(argv, demo=demo_checkpoint())


def _help() -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<10} {spec[2]}" for name, spec in SUBCOMMANDS.items()]
    lines += ["", f"deltaserve {deltaserve.__version__}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"deltaserve {deltaserve.__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"deltaserve: error: unknown command {name!r}\n{USAGE}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a real missing dependency inside the module
        print(
            f"deltaserve: error: '{name}' is not available yet in this build "
            f"({module_name} is missing)",
            file=sys.stderr,
        )
        return 2
    code = getattr(module, func_name)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
