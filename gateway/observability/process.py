"""This process's CPU time, memory and file descriptors, read from ``/proc`` as every Python
exporter reports them (prometheus-client's ``ProcessCollector`` does the reading).

Each worker reads its own at snapshot time (once a second and per scrape), so ``/metrics`` shows
every worker's figures whichever worker answers it.
"""

from __future__ import annotations

from prometheus_client.process_collector import ProcessCollector

# The figures, named as the ``process_`` metrics are (``_total`` dropped from the counter).
PROCESS_FIGURES = (
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)

_collector: ProcessCollector | None = None


def read_process() -> dict[str, float]:
    """The figures of ``PROCESS_FIGURES`` this system has (none without ``/proc``)."""
    global _collector
    if _collector is None:
        _collector = ProcessCollector(registry=None)
    return {
        family.name: family.samples[0].value
        for family in _collector.collect()
        if family.name in PROCESS_FIGURES and family.samples
    }
