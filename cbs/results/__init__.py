"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`), the
write-once parts that several processes add records to, merged on read and compacted on object
stores (`shared`), local and remote paths (`paths`), claims that let launchers share a directory
(`leases`), the sweep directory (`store`), the names of the files runs, sweeps and studies
write (`files`), the metric writers (`writers`: one interface, JSON lines, TensorBoard,
W&B), the calibration file with the prediction of B_crit its model gives (`calibration`,
the shipped file that the analysis fits and a training run reads) and the command that
installs an optional extra, which every missing-extra error names (`extras`). Imports no
other cbs package.
"""

__all__ = [
    "calibration", "extras", "files", "leases", "paths", "records", "shared", "store", "writers",
]  # its modules
