"""The packaged preset `cbs.configs.ramp_llama3_style` by its repository path
(`--config=ramp_llama3_style` names the same preset without a checkout)."""

from cbs.configs.ramp_llama3_style import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.ramp_llama3_style import get_config  # noqa: F401 (what --config=<this file> loads)
