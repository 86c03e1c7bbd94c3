"""``python -m trtllm_mock`` runs the same CLI as the ``trtllm-mock`` console script."""

import sys

from .cli import main

sys.exit(main())
