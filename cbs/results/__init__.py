"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`), the
sweep directory (`store`) and the names of the files runs, sweeps and studies write (`files`).
Imports no other cbs package.
"""
