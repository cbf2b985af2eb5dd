"""``neps-bcast launch``: K DDP groups per node, each one NePS worker, on torch's launcher.

``plan.py`` decides and checks what to start (before anything starts), ``groups.py``
runs one ``torchrun --standalone`` per group and stops them all, ``status.py`` reads each
group's leader log for the status lines, ``rank_log.py`` runs inside every rank to give
it a log file of its own, ``cli.py`` is the command line. ``search_status.py`` (its
text and plot in ``search_text.py``, ``search_plot.py``) is ``neps-bcast status``: it
reads what a search leaves in each trial's directory, the leaders' leases
(``lease_record.py``) and a pool's placements (``trial_placement.py``), the two formats
the leaders and the pool import from here.
"""

from __future__ import annotations
