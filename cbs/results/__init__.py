"""On-disk formats every layer shares: JSON-lines records and atomic writes (`records`) and
the sweep directory (`store`). Imports no other cbs package.
"""
