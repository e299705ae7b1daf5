"""The packaged preset `cbs.configs.heldout_sweep` by its repository path
(`--config=heldout_sweep` names the same preset without a checkout)."""

from cbs.configs.heldout_sweep import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.heldout_sweep import get_config  # noqa: F401 (what --config=<this file> loads)
