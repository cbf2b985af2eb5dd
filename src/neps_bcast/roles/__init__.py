"""The two roles, one place each: ``leader`` (the search's orchestration: root lock,
leases, ``neps.run``, STOP) with ``leader_trial`` (its side of each trial NePS hands
it), and ``follower`` (receive, evaluate, report, goodbye). ``api`` hands a process to
one of them.
"""
