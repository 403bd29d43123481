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


def parse(module, assign: str) -> tuple[str, object]:
    """("NAME=VALUE", module) -> (NAME, the literal VALUE); ValueError unless `module` already
    defines NAME (a misspelt name is refused rather than silently added) and VALUE is a Python literal."""
    name, eq, value = assign.partition("=")
    name = name.strip()
    if not eq or not name:
        raise ValueError(f"setting {assign!r} is not of the form NAME=VALUE")
    if not hasattr(module, name):
        raise ValueError(f"{module.__name__} has no setting {name!r}")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"value {value!r} of {assign!r} is not a Python literal") from None


def apply(spec: str) -> str:
    """Set one "package.module:NAME=VALUE" setting; returns a line saying what was set."""
    mod, colon, assign = spec.partition(":")
    if not colon:
        raise SystemExit(f"setting {spec!r} is not of the form package.module:NAME=VALUE")
    m = importlib.import_module(mod)
    try:
        name, parsed = parse(m, assign)
    except ValueError as e:
        raise SystemExit(f"{spec!r}: {e}") from None
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
