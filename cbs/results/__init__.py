"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`), the
sweep directory (`store`), the names of the files runs, sweeps and studies write (`files`) and
paths every host sees, local or in an object store (`paths`). Imports no other cbs package.
"""

__all__ = ["files", "paths", "records", "store"]  # its modules
