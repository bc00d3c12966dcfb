"""The command line's own behaviour: every command and option explains itself."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from quiverd.cli import main as cli


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]:
    """(words, parser, help line) of every command and sub-command, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*prefix, name), sub, lines.get(name)
                yield from commands(sub, (*prefix, name))


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def flat(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help text at the terminal width


def test_main_help_of_every_command_lists_each_option_with_its_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    found = list(commands(cli._parser()))
    names = {" ".join(words) for words, _, _ in found}
    assert {"serve", "send", "status", "wal dump", "files list", "compact"} <= names
    for words, parser, line in found:
        assert line, f"`quiverd {' '.join(words)}` has no help line"
        with pytest.raises(SystemExit) as done:
            cli.main([*words, "--help"])
        assert done.value.code == 0
        out = flat(capsys.readouterr().out)
        assert flat(line) in out  # the command's line heads its own help
        for action in arguments(parser):
            name = action.option_strings[0] if action.option_strings else action.metavar
            assert action.help, f"`quiverd {' '.join(words)}`: {name or action.dest} has no help"
            assert (name or action.dest) in out and flat(action.help) in out, (words, out)


@pytest.mark.parametrize(("command", "expected"), [
    (["serve"], ["--config CONFIG", "the config file (default /etc/quiverd/config.toml)"]),
    (["send"], ["--socket SOCKET", "the daemon's ingest socket", "--client CLIENT",
                "the bundles' client name", "FILE", "Arrow IPC (file or stream) or Parquet"]),
])
def test_main_serve_and_send_help_as_a_user_runs_it(command: list[str],
                                                    expected: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "quiverd", *command, "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for needle in expected:
        assert needle in flat(proc.stdout), proc.stdout
