"""On-disk formats every layer shares: records and atomic writes (`records`), write-once parts
(`shared`), local and remote paths (`paths`), claims (`leases`), the sweep directory (`store`),
file names (`files`), metric writers (`writers`), the calibration and its prediction
(`calibration`) and the install command of an optional extra (`extras`). Imports no other cbs
package.
"""

__all__ = [
    "calibration", "extras", "files", "leases", "paths", "records", "shared", "store", "writers",
]  # its modules
