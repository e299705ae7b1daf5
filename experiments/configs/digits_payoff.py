"""The packaged preset `cbs.configs.digits_payoff` by its repository path
(`--config=digits_payoff` names the same preset without a checkout)."""

from cbs.configs.digits_payoff import *  # noqa: F403 (the module's names, for imports from here)
from cbs.configs.digits_payoff import get_config  # noqa: F401 (what --config=<this file> loads)
