"""The packaged preset `cbs.configs.shakespeare_branch` by its repository path
(`--config=shakespeare_branch` names the same preset without a checkout)."""

from cbs.configs.shakespeare_branch import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.shakespeare_branch import get_config  # noqa: F401 (what --config=<this file> loads)
