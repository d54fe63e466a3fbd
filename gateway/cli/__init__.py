"""The command line (``gateway run / check / schema / healthcheck / replay``), log set-up, and the
supervisor of ``--workers N``."""
