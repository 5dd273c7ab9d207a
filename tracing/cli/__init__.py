"""The command line, ``python -m tracing {run, export, info, eval, diff, atlas}``: the commands, the
atlas command, opening a model from its flags (loading), outputs written whole or not at all
(output) and the progress bar."""


def main(argv: list[str] | None = None) -> int:
    """``python -m tracing``'s entry (tracing.cli.commands.main), imported when called."""
    from .commands import main as run

    return run(argv)
