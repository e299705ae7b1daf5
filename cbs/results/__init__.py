"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`), the
write-once parts that several processes add records to, merged on read and compacted on object
stores (`shared`), local and remote paths (`paths`), claims that let launchers share a directory
(`leases`), the sweep directory (`store`), the names of the files runs, sweeps and studies
write (`files`) and the metric writers (`writers`: one interface, JSON lines, TensorBoard,
W&B). Imports no other cbs package.
"""

__all__ = ["files", "leases", "paths", "records", "shared", "store", "writers"]  # its modules
