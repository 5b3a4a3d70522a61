"""The flag reference of docs/flags.md, rendered from the dataclasses of jaxspec/args.py.

    python -c "from jaxspec.flag_docs import flag_table; print(flag_table())"

prints it; tests/test_args.py keeps docs/flags.md equal to it, and checks every command's --help
against COMMANDS.
"""

from __future__ import annotations

import dataclasses
import typing

from jaxspec.args import GROUPS, ModelArgs, MultiHostArgs, ServerArgs, SpeculativeArgs
from jaxspec.cli_flags import _scalar_type, option

# which commands take which group (the flag table in docs/flags.md and the --help test read this)
COMMANDS: dict[type, tuple[str, ...]] = {
    ModelArgs: ("generate", "serve", "bench"),
    MultiHostArgs: ("generate", "serve", "bench"),
    SpeculativeArgs: ("generate", "serve", "bench"),
    ServerArgs: ("serve",),
}


def flag_table() -> str:
    """The flag reference of docs/flags.md: one Markdown table per group."""
    out = []
    for cls, cmds in COMMANDS.items():
        out.append(f"**{GROUPS[cls]}** — `jaxspec {'`, `'.join(cmds)}`\n")
        out.append("| flag | default | meaning |")
        out.append("|---|---|---|")
        for f in dataclasses.fields(cls):
            default = "" if f.default is None else f"`{f.default}`"
            choices = f"; one of {', '.join(f.metadata['choices'])}" if f.metadata["choices"] else ""
            name = " / ".join(f"`{n}`" for n in (option(f.name), *f.metadata.get("aliases", ())))
            if f.default is None and _scalar_type(typing.get_type_hints(cls)[f.name]) is bool:
                name += f" / `--no-{option(f.name)[2:]}`"
            out.append(f"| {name} | {default} | {f.metadata['help'].replace('|', '/')}{choices} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
