"""Run a module with some module-level settings changed first (the A/B switches the kernels read
when a program is traced: `pallas_kernels.moe_experts.LATE_SCALE_WAITS`,
`lingjax.model.dspark.ATTENTION_KERNEL`, ...).

    python -m bench.with_settings "pallas_kernels.moe_experts:LATE_SCALE_WAITS=False" \\
        -m bench.batch1 --random-weights --dtype fp8 ...

Each SETTING is "package.module:NAME=VALUE" with VALUE a Python literal; the module must already
define NAME (a misspelt name is refused rather than silently added). The settings are applied in
order, then the module after -m runs as __main__ with the remaining arguments.
"""
from __future__ import annotations

import ast
import importlib
import runpy
import sys


def apply(spec: str) -> str:
    """Set one "package.module:NAME=VALUE" setting; returns a line saying what was set."""
    try:
        mod, assign = spec.split(":", 1)
        name, value = assign.split("=", 1)
    except ValueError:
        raise SystemExit(f"setting {spec!r} is not of the form package.module:NAME=VALUE") from None
    m = importlib.import_module(mod)
    if not hasattr(m, name):
        raise SystemExit(f"{mod} has no setting {name!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise SystemExit(f"value {value!r} of {spec!r} is not a Python literal") from None
    setattr(m, name, parsed)
    return f"[with_settings] {mod}.{name} = {parsed!r}"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-m" not in args or args.index("-m") == len(args) - 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    cut = args.index("-m")
    for spec in args[:cut]:
        print(apply(spec), flush=True)
    module, rest = args[cut + 1], args[cut + 2:]
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
