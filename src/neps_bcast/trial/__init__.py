"""One trial on one rank, as every rank (leader, follower, a pool's rank) evaluates it:
``run`` (top to bottom: the meeting at ``session()``, a failure published, the
trial-end exchange), ``session`` (``session()`` and ``Trial``, the user's side),
``forming`` (the user's group formed for a trial) and ``failure`` (a rank's failure and
how every other rank learns it).

Nothing is imported here: ``neps_bcast.session`` and ``neps_bcast.Trial`` are the
public names (``neps_bcast/__init__.py``).
"""
