"""The packaged preset `cbs.configs.lm_shakespeare` by its repository path
(`--config=lm_shakespeare` names the same preset without a checkout)."""

from cbs.configs.lm_shakespeare import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.lm_shakespeare import get_config  # noqa: F401 (what --config=<this file> loads)
