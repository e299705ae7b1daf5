"""`cbs.train`: the public import path of `cbs.engine.trainer` (the same module object)."""

import sys

from cbs.engine import trainer as _module

sys.modules[__name__] = _module
