"""The helpers of `cbs.configs.base` by their repository path."""

from cbs.configs.base import *  # noqa: F403 (the module's names, for imports from here)
