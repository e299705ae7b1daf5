"""On-disk formats every layer shares: JSON-lines records, write-once parts and atomic writes
(`records`), local and remote paths (`paths`), claims that let launchers share a directory
(`leases`), the sweep directory (`store`) and the names of the files runs, sweeps and studies
write (`files`). Imports no other cbs package.
"""
