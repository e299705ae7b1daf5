"""`cbs.fit`: the public import path of `cbs.analysis.fit` (the same module object)."""

import sys

from cbs.analysis import fit as _module

sys.modules[__name__] = _module
