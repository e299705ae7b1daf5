"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`),
write-once parts that several processes add records to (`shared`), local and remote paths
(`paths`), claims that let launchers share a directory (`leases`), the sweep directory
(`store`), the names of the files written (`files`), the metric writers (`writers`), the
calibration file and its prediction of B_crit (`calibration`) and the install command of an
optional extra (`extras`). Imports no other cbs package.
"""

__all__ = [
    "calibration", "extras", "files", "leases", "paths", "records", "shared", "store", "writers",
]  # its modules
