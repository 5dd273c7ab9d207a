import sys

import model  # noqa: F401  first: the package sets OMP_WAIT_POLICY, which torch reads when it loads

from .cli import main

sys.exit(main())
