"""`cbs.curvature`: the public import path of `cbs.stats.curvature` (the same module object)."""

import sys

from cbs.stats import curvature as _module

sys.modules[__name__] = _module
