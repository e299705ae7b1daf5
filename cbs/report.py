"""`cbs.report`: the public import path of `cbs.analysis.report` (the same module object)."""

import sys

from cbs.analysis import report as _module

sys.modules[__name__] = _module
