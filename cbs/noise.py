"""`cbs.noise`: the public import path of `cbs.stats.noise` (the same module object)."""

import sys

from cbs.stats import noise as _module

sys.modules[__name__] = _module
