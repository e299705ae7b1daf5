"""On-disk formats every layer shares: JSON-lines records, write-once parts and atomic writes
(`records`), local and remote paths (`paths`), claims that let launchers share a directory
(`leases`), the sweep directory (`store`), the names of the files runs, sweeps and studies
write (`files`) and the metric writers (`writers`: one interface, JSON lines, TensorBoard,
W&B). Imports no other cbs package.
"""

__all__ = ["files", "leases", "paths", "records", "store", "writers"]  # its modules
