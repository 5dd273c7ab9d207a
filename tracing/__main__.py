import sys

from tracing.startup import load_torch

load_torch()  # first: idle OpenMP threads sleep (tracing.startup)

from tracing.cli.commands import main  # noqa: E402

sys.exit(main())
