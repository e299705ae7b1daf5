"""The helpers of `cbs.configs.digits_ramp_base` by their repository path."""

from cbs.configs.digits_ramp_base import *  # noqa: F403 (the module's names, for imports from here)
