"""The packaged preset `cbs.configs.mnist1d_mlp` by its repository path
(`--config=mnist1d_mlp` names the same preset without a checkout)."""

from cbs.configs.mnist1d_mlp import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.mnist1d_mlp import get_config  # noqa: F401 (what --config=<this file> loads)
