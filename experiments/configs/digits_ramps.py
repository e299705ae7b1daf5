"""The packaged preset `cbs.configs.digits_ramps` by its repository path
(`--config=digits_ramps` names the same preset without a checkout)."""

from cbs.configs.digits_ramps import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.digits_ramps import get_config  # noqa: F401 (what --config=<this file> loads)
