"""The packaged preset `cbs.configs.digits_branch` by its repository path
(`--config=digits_branch` names the same preset without a checkout)."""

from cbs.configs.digits_branch import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.digits_branch import get_config  # noqa: F401 (what --config=<this file> loads)
