"""The packaged preset `cbs.configs.ramp_adaptive` by its repository path
(`--config=ramp_adaptive` names the same preset without a checkout)."""

from cbs.configs.ramp_adaptive import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.ramp_adaptive import get_config  # noqa: F401 (what --config=<this file> loads)
