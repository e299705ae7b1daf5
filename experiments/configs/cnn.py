"""The packaged preset `cbs.configs.cnn` by its repository path
(`--config=cnn` names the same preset without a checkout)."""

from cbs.configs.cnn import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.cnn import get_config  # noqa: F401 (what --config=<this file> loads)
