"""Divergence → cause: which stage, which change, which piece of hardware made an output deviate.

``population`` finds deviating requests, their baselines and first divergent stages in SQL;
``causes`` ranks attribute differences by contrast; ``hardware`` finds error counters that rose on a
stage's devices; ``explain`` and ``divergences`` are the two commands built on them.
"""
