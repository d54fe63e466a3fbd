"""A policy exercised before it is deployed: ``gateway test`` (cases written as requests at
virtual instants, and what must come of them) and ``gateway simulate`` (an arrival pattern
drawn against the policy). Both run the live engine on a virtual clock, through replay's
``Simulation``."""
