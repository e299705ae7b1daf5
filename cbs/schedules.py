"""`cbs.schedules`: the public import path of `cbs.engine.schedules` (the same module object)."""

import sys

from cbs.engine import schedules as _module

sys.modules[__name__] = _module
