"""Right-sized trials on one node's D devices (``neps-bcast launch --pool D``), as a mode
of the same roles (docs/architecture.md, "Right-sized trials: the pool"):

- ``launcher`` (the launch's side, no torch, no NePS): D warm ranks and D agents, the
  placement of each trial onto free devices (``placement``), the relay between them;
- ``agent``: what a NePS worker without a device hands the leader's loop in place of
  its own group (``Remote``: each trial to the ranks it is given, their outcome back);
- ``rank``: a warm rank's life, trial after trial, each its own DDP group;
- ``wire``: the Unix socket between them, every record from a process that proved the
  pool's key (``opening``).

The three sides never import one another: they meet on the wire.
"""
