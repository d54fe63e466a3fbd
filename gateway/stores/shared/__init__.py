"""Limit state shared by the workers of one gateway on one machine (LMDB): the runtime
directory, the byte records, and the store itself."""
