"""The command line, ``python -m tracing COMMAND``: the parser and its entry (commands), one module
per command (run, diff, export, info, eval, atlas, patching, plan, serve), opening a model from its
flags (loading), the flags' rules (inputs), outputs written whole or not at all (output) and the
progress bar."""


def main(argv: list[str] | None = None) -> int:
    """``python -m tracing``'s entry (tracing.cli.commands.main), imported when called."""
    from .commands import main as run

    return run(argv)
