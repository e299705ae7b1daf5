"""The packaged preset `cbs.configs.shakespeare_transformer` by its repository path
(`--config=shakespeare_transformer` names the same preset without a checkout)."""

from cbs.configs.shakespeare_transformer import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.shakespeare_transformer import get_config  # noqa: F401 (what --config=<this file> loads)
