"""Carrying schedules out for real: the simulator's decisions executed on Ray with real training.

``training`` (a small numpy CNN on scikit-learn's digits), ``actors`` (parameter server and worker groups),
``ray_executor`` (the execution part of the simulator's loop), ``command`` (``deepco schedule --execute ray``).
Ray is imported only when a schedule is executed, so the core install works without it.
"""
