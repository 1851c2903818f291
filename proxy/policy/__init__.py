"""Which policy is serving: the admission gate a weight sync pauses, the pause and policy
version shared by every process on one database, and the version that produced each
token of a call.

Owns: `gate`, `controls`, `versions`.
May import: `http`.
"""
