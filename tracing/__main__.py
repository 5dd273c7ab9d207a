import sys

try:  # Ctrl-C while torch and the project load (seconds): the one line of any interrupted command
    from tracing.startup import load_torch

    load_torch()  # first: idle OpenMP threads sleep (tracing.startup)

    from tracing.cli.commands import main
except KeyboardInterrupt:
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)

sys.exit(main())
