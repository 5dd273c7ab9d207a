import os
import sys

# Idle OpenMP threads sleep instead of spinning: on a busy 2-core machine spinning threads made a
# small model's forward 75x slower. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .cli import main  # noqa: E402

sys.exit(main())
