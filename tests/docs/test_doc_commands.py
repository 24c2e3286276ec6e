"""Every ``mismatch-probe`` command line the docs show names a command, flags and settings that
exist: renaming a flag or a setting without updating README.md, ARCHITECTURE.md and docs/ fails here."""

from __future__ import annotations

import pytest
from doc_blocks import Command, cli_options, commands

GLOBAL = {"--debug", "--help"}


@pytest.fixture(scope="module")
def cli() -> dict[str, set[str]]:
    return cli_options()


@pytest.fixture(scope="module")
def setting_keys() -> set[str]:
    from mismatch_probe.config.spec import spec_settings

    return set(spec_settings())


def broken_references(shown: list[Command], cli: dict[str, set[str]], setting_keys: set[str]) -> list[str]:
    broken = []
    for c in shown:
        words = [w.strip("[]()|,.`'\"") for w in c.words]
        subcommand = c.subcommand.strip("[]")
        while subcommand in GLOBAL and words:  # mismatch-probe [--debug] compare ...
            subcommand, words = words[0], words[1:]
        if subcommand in GLOBAL or subcommand.isupper():  # `mismatch-probe --help`, `mismatch-probe COMMAND`
            continue
        if subcommand not in cli:
            broken.append(f"{c.where}: no command {subcommand!r} in `{c.text}`")
            continue
        for i, word in enumerate(words):
            if not word.startswith("--") or len(word) == 2:
                continue
            for flag in word.split("=", 1)[0].split("/"):  # --resume/--no-resume
                if flag not in cli[subcommand]:
                    broken.append(f"{c.where}: `{subcommand}` has no {flag} (`{c.text}`)")
            if word.split("=", 1)[0] == "--set":
                value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
                key = value.split("=", 1)[0]
                if "=" in value and "." in key and key not in setting_keys:
                    broken.append(f"{c.where}: --set {key}: no such setting (`{c.text}`)")
    return broken


def test_the_docs_show_every_command(cli):
    shown = commands()
    assert len(shown) > 100, len(shown)  # the scan sees them
    assert {c.subcommand for c in shown} >= set(cli) - {"engines"}


def test_every_command_flag_and_setting_in_the_docs_exists(cli, setting_keys):
    broken = broken_references(commands(), cli, setting_keys)
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("mismatch-probe compare probes/demo.toml --engine-dtyp bfloat16", "`compare` has no --engine-dtyp"),
        ("mismatch-probe score RUN --set reference.dtyp=float32", "--set reference.dtyp: no such setting"),
        ("mismatch-probe comprae probes/demo.toml", "no command 'comprae'"),
        ("mismatch-probe sweep S [--resume/--no-resum]", "`sweep` has no --no-resum"),
    ],
)
def test_a_renamed_flag_setting_or_command_is_found(cli, setting_keys, line, found):
    words = line.split()
    broken = broken_references([Command("page.md:1", line, words[1], words[2:])], cli, setting_keys)
    assert len(broken) == 1 and found in broken[0], broken


def test_a_correct_line_is_not_flagged(cli, setting_keys):
    line = "mismatch-probe --debug score RUN --out NEW --set reference.dtype=float32 [--overwrite]"
    words = line.split()
    assert broken_references([Command("page.md:1", line, words[1], words[2:])], cli, setting_keys) == []
