"""Limit state shared by the workers of one gateway on one machine (LMDB): the runtime
directory, the byte records, the tables as a reload administers them, and the store's request
path."""
