"""`python -m checkpoints_convert HF_DIR OUT_DIR`: see checkpoints_convert.cli."""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # converting never needs an accelerator

from checkpoints_convert.cli import main  # noqa: E402

sys.exit(main())
