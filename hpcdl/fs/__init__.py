"""Files on a shared file system, beneath the exchange and the run directory: atomic publication
and appends (`files`), access policies (`access`), and full-disk reports (`storage`).
"""
